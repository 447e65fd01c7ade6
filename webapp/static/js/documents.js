// Drag and drop onto the upload form: the dropped files become the input's files and the
// form is submitted through htmx (choosing files with the picker submits the same way).
document.addEventListener("DOMContentLoaded", () => {
  const form = document.getElementById("upload-form");
  const zone = document.getElementById("dropzone");
  const input = document.getElementById("upload-files");
  if (!form || !zone || !input) return;
  const submit = () => {
    if (!input.files.length) return;
    if (window.htmx) window.htmx.trigger(form, "submit"); else form.submit();
  };
  ["dragenter", "dragover"].forEach((name) => zone.addEventListener(name, (event) => {
    event.preventDefault();
    zone.classList.add("over");
  }));
  ["dragleave", "drop"].forEach((name) => zone.addEventListener(name, () => zone.classList.remove("over")));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    input.files = event.dataTransfer.files;
    submit();
  });
  input.addEventListener("change", submit);
  // Choosing files uploads them, so there is nothing left for an Upload button to do (pressed
  // after a choice, it only answered "Choose one or more files"): it is there without
  // JavaScript, where choosing does not upload.
  document.getElementById("upload-button").hidden = true;
  document.getElementById("upload-hint").hidden = false;
  // After an htmx upload, clear the picker so the same file can be chosen again.
  form.addEventListener("htmx:afterRequest", () => { input.value = ""; });
});
