// Every page: a button with data-toggles="ID" opens and closes element ID (the nav behind
// Menu, the conversation list on a phone), data-closes="ID" closes it, and Escape closes
// whatever is open. On the chat page a citation opens its passage in the citation panel,
// an overlay on small screens (responsive.css), moves focus to it and scrolls it to the
// cited sentence.
(function () {
  "use strict";

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

  // The cited sentence a third of the way down the panel (a passage taller than the panel
  // would otherwise show its top, and the highlight, say a footer's, out of sight).
  function scrollToHighlight(panel) {
    const mark = panel.querySelector("mark.cited-sentence");
    if (!mark) {
      panel.scrollTop = 0;
      return;
    }
    const offset = mark.getBoundingClientRect().top - panel.getBoundingClientRect().top;
    panel.scrollTop += offset - panel.clientHeight / 3;
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
