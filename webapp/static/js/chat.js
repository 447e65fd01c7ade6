// The chat page: Enter sends (Shift+Enter: a new line), Ask waits while an answer streams,
// the page follows a streaming answer unless the reader scrolled up (Copy: app.js).
(function () {
  "use strict";

  function streaming() {
    return document.querySelector("#messages [sse-connect]") !== null;
  }

  function update() {
    const button = document.querySelector("#ask-form button[type=submit]");
    if (button) {
      button.disabled = streaming();
      button.title = button.disabled ? "Wait for the answer to finish (or stop it)" : "";
    }
  }

  function nearBottom() {
    const scroller = document.scrollingElement;
    return scroller.scrollHeight - scroller.scrollTop - scroller.clientHeight < 120;
  }

  document.addEventListener("keydown", function (event) {
    const box = event.target;
    if (box.name !== "question" || !box.form || box.form.id !== "ask-form") return;
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!streaming() && box.value.trim()) box.form.requestSubmit();
    }
  });

  let follow = true;
  document.addEventListener("htmx:sseBeforeMessage", function () { follow = nearBottom(); });
  document.addEventListener("htmx:sseMessage", function () {
    if (follow) window.scrollTo(0, document.scrollingElement.scrollHeight);
  });
  ["htmx:afterSwap", "htmx:afterSettle", "htmx:sseClose", "DOMContentLoaded"].forEach(function (name) {
    document.addEventListener(name, update);
  });
})();
