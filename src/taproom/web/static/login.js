"use strict";
// The form posts the token; the server answers with a session cookie or ?failed=1.
if (new URLSearchParams(location.search).has("failed")) {
  document.getElementById("failed").hidden = false;
}
