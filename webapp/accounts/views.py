"""Account pages: the user's API keys (create, list, revoke). A new key's plaintext is shown
once, on the page that answers its creation, and never again."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from webapp.accounts import selectors, services
from webapp.accounts.models import ApiKey


def _get_api_key_for_user(request: HttpRequest, api_key_id: int) -> ApiKey:
    api_key = selectors.api_key_get(user=request.user, api_key_id=api_key_id)
    if api_key is None:
        raise Http404("No such key.")
    return api_key


@login_required
@require_http_methods(["GET", "POST"])
def api_key_list(request: HttpRequest) -> HttpResponse:
    context: dict[str, object] = {}
    status = 200
    if request.method == "POST":
        try:
            api_key, plaintext = services.api_key_create(
                user=request.user, name=request.POST.get("name", "")
            )
            context |= {"new_key": api_key, "plaintext": plaintext}
        except services.ApiKeyError as err:
            context["error"] = str(err)
            status = 422
    context["api_keys"] = selectors.api_key_list(user=request.user)
    response = render(request, "accounts/api_keys.html", context, status=status)
    response["Cache-Control"] = "no-store"  # the page may carry a plaintext key
    return response


@login_required
@require_POST
def api_key_revoke(request: HttpRequest, api_key_id: int) -> HttpResponse:
    api_key = _get_api_key_for_user(request, api_key_id)
    services.api_key_revoke(api_key=api_key)
    messages.success(request, f"Key “{api_key.name}” revoked.")
    return redirect("api_keys")
