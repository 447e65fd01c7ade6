// Every page: a Copy button copies its text; a button with data-toggles="ID" opens and
// closes element ID (the nav behind Menu, the conversation list on a phone), data-closes="ID"
// closes it, and Escape closes whatever is open. On the chat page a citation opens its
// passage in the citation panel, an overlay on small screens (responsive.css), moves focus
// to it and scrolls it to the cited sentence.
(function () {
  "use strict";

  // Copy: a button.copy puts its data-copy on the clipboard (an answer as written, with its
  // [n] markers; a new API key; an invite link); where the page is not a secure context
  // (plain HTTP to a host name) through a selected text area.
  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    const copied = document.execCommand("copy");
    area.remove();
    return copied ? Promise.resolve() : Promise.reject(new Error("copy refused"));
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("button.copy");
    if (!button) return;
    const label = button.dataset.label || (button.dataset.label = button.textContent);
    copyText(button.dataset.copy).then(
      function () { button.textContent = "Copied"; },
      function () { button.textContent = "Copy failed"; }
    );
    setTimeout(function () { button.textContent = label; }, 2000);
  });

  function setOpen(target, open) {
    target.classList.toggle("open", open);
    document.querySelectorAll('[data-toggles="' + target.id + '"]').forEach(function (button) {
      button.setAttribute("aria-expanded", String(open));
    });
  }

  document.addEventListener("click", function (event) {
    const toggle = event.target.closest("[data-toggles]");
    if (toggle) {
      const target = document.getElementById(toggle.dataset.toggles);
      if (target) setOpen(target, !target.classList.contains("open"));
      return;
    }
    const close = event.target.closest("[data-closes]");
    if (close) {
      const target = document.getElementById(close.dataset.closes);
      if (target) setOpen(target, false);
    }
  });

  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
    document.querySelectorAll(".open[id]").forEach(function (element) { setOpen(element, false); });
  });

  // The cited sentence a third of the way down the panel below its title, which stays at
  // the top (a passage taller than the panel would otherwise show its top, and the
  // highlight, say a footer's, out of sight).
  function scrollToHighlight(panel) {
    const mark = panel.querySelector("mark.cited-sentence");
    if (!mark) {
      panel.scrollTop = 0;
      return;
    }
    const head = panel.querySelector(".panel-head");
    const covered = head ? head.offsetHeight : 0;
    const offset = mark.getBoundingClientRect().top - panel.getBoundingClientRect().top;
    panel.scrollTop += offset - covered - (panel.clientHeight - covered) / 3;
  }

  document.addEventListener("htmx:afterSwap", function (event) {
    if (event.detail.target.id !== "citation-panel") return;
    const overlay = document.getElementById("citation-overlay");
    if (!overlay) return;
    setOpen(overlay, true);
    overlay.focus({ preventScroll: true });
    scrollToHighlight(overlay);
  });
})();
