"""Account pages: the user's API keys (create, list, revoke), the staff's users page (add a
user) and invites page (make an invite link), the page an invite link opens, and self
sign-up when SIGNUP_ENABLED. A new key's plaintext, a new user's password and a new invite's
link are shown once, on the page that answers their creation, and never again. Changing one's
password is Django's PasswordChangeView. Logging in and signing up (with an invite or without)
are rate limited per client address, and wrong passwords lock an account's password logins for
a while (ratelimits.py): staff lift that lock on the users page, and a password change does."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model, login
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import UserCreationForm
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse, reverse_lazy
from django.utils.decorators import method_decorator
from django.views.decorators.http import require_http_methods, require_POST

from webapp.accounts import selectors, services
from webapp.accounts.decorators import staff_required
from webapp.accounts.models import ApiKey, Invite
from webapp.accounts.ratelimits import limit_posts, lock_accounts

# The backend a new account is signed in with (axes' own backend only checks lockouts).
SIGN_IN_BACKEND = "django.contrib.auth.backends.ModelBackend"


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


@method_decorator(limit_posts("login"), name="dispatch")
@method_decorator(lock_accounts, name="dispatch")
class LoginView(auth_views.LoginView):
    """Django's login page, which links to sign-up when it is on."""

    template_name = "accounts/login.html"
    redirect_authenticated_user = True

    def get_context_data(self, **kwargs) -> dict[str, object]:
        return super().get_context_data(**kwargs) | {"signup_enabled": settings.SIGNUP_ENABLED}


class PasswordChangeView(auth_views.PasswordChangeView):
    """Django's password change, which also lifts a lock on the account's password logins:
    the wrong passwords tried were guesses at the old one."""

    template_name = "accounts/password_change.html"
    success_url = reverse_lazy("password_change_done")

    def form_valid(self, form) -> HttpResponse:
        response = super().form_valid(form)
        services.login_unlock(username=form.user.get_username())
        return response


@staff_required
@require_http_methods(["GET", "POST"])
def user_list(request: HttpRequest) -> HttpResponse:
    context: dict[str, object] = {}
    status = 200
    if request.method == "POST":
        try:
            new_user, password = services.user_create(
                username=request.POST.get("username", ""),
                email=request.POST.get("email", ""),
                password=request.POST.get("password", ""),
            )
            context |= {"new_user": new_user, "password": password}
        except services.UserCreateError as err:
            context |= {"error": str(err), "form_values": request.POST}
            status = 422
    context |= {
        "users": selectors.user_list_with_login_locks(),
        "login_failure_limit": settings.LOGIN_ACCOUNT_FAILURE_LIMIT,
        "lockout_minutes": round(settings.LOGIN_ACCOUNT_LOCKOUT.total_seconds() / 60),
    }
    response = render(request, "accounts/users.html", context, status=status)
    response["Cache-Control"] = "no-store"  # the page may carry a new user's password
    return response


@staff_required
@require_POST
def user_unlock(request: HttpRequest, user_id: int) -> HttpResponse:
    """Staff lift the locks on a user's password logins (too many wrong passwords)."""
    username = get_object_or_404(get_user_model(), pk=user_id).get_username()
    if services.login_unlock(username=username):
        messages.success(request, f"Password logins for “{username}” unlocked.")
    else:
        messages.error(request, "Nothing was unlocked: a service is down. Try again shortly.")
    return redirect("users")


@limit_posts("signup")
@require_http_methods(["GET", "POST"])
def signup(request: HttpRequest) -> HttpResponse:
    """Self sign-up, a 404 unless SIGNUP_ENABLED; the new user is logged in."""
    if not settings.SIGNUP_ENABLED:
        raise Http404("Sign-up is off.")
    if request.user.is_authenticated:
        return redirect(settings.LOGIN_REDIRECT_URL)
    form = UserCreationForm(request.POST if request.method == "POST" else None)
    if form.is_valid():
        try:
            user, _ = services.user_create(
                username=form.cleaned_data["username"],
                password=form.cleaned_data["password1"],
            )
        except services.UserCreateError as err:
            form.add_error(None, str(err))
        else:
            login(request, user, backend=SIGN_IN_BACKEND)
            return redirect(settings.LOGIN_REDIRECT_URL)
    status = 422 if form.is_bound else 200
    return render(request, "accounts/signup.html", {"form": form}, status=status)


def _posted_days(request: HttpRequest) -> int | None:
    """The "valid for" days posted: None when blank (the default); anything but a number is
    0, which invite_create refuses with the days allowed."""
    raw = request.POST.get("days", "").strip()
    if not raw:
        return None
    return int(raw) if raw.isdecimal() and len(raw) <= 4 else 0


@staff_required
@require_http_methods(["GET", "POST"])
def invite_list(request: HttpRequest) -> HttpResponse:
    """Staff make an invite link (shown once) and see the latest invites and their state."""
    context: dict[str, object] = {}
    status = 200
    if request.method == "POST":
        try:
            invite, token = services.invite_create(
                created_by=request.user,
                username=request.POST.get("username", ""),
                email=request.POST.get("email", ""),
                valid_days=_posted_days(request),
            )
            link = request.build_absolute_uri(reverse("invite_accept", args=[token]))
            context |= {"new_invite": invite, "invite_link": link}
        except services.InviteError as err:
            context |= {"error": str(err), "form_values": request.POST}
            status = 422
    context |= {
        "invites": selectors.invite_list(),
        "default_days": settings.INVITE_VALID_DAYS,
        "max_days": services.INVITE_MAX_DAYS,
    }
    response = render(request, "accounts/invites.html", context, status=status)
    response["Cache-Control"] = "no-store"  # the page may carry a new invite's link
    return response


@staff_required
@require_POST
def invite_withdraw(request: HttpRequest, invite_id: int) -> HttpResponse:
    """Staff take back an invite nobody has used yet; its link then says it expired."""
    invite = get_object_or_404(Invite, pk=invite_id)
    if services.invite_withdraw(invite=invite):
        messages.success(
            request, f"Invite for {invite.username or invite.email or 'anyone'} withdrawn."
        )
    else:
        messages.info(request, "That invite was used or had expired already: nothing changed.")
    return redirect("invites")


def _invite_form(invite: Invite, data=None) -> UserCreationForm:
    """The sign-up form of an invite; its username fixed when the invite names one."""
    form = UserCreationForm(data, initial={"username": invite.username})
    if invite.username:
        form.fields["username"].disabled = True
    return form


def _invite_refused(request: HttpRequest, error: services.InviteError) -> HttpResponse:
    status = 404 if isinstance(error, services.InviteNotFound) else 410
    response = render(request, "accounts/invite_refused.html", {"reason": error}, status=status)
    response["Cache-Control"] = "no-store"
    return response


@limit_posts("signup")
@require_http_methods(["GET", "POST"])
def invite_accept(request: HttpRequest, token: str) -> HttpResponse:
    """What an invite link opens: pick a username (unless the invite names one) and a
    password, and be signed in as the new account. A link used, expired or unknown is a page
    that says which."""
    try:
        invite = services.invite_check(selectors.invite_get(token=token))
    except services.InviteError as err:
        return _invite_refused(request, err)
    form = _invite_form(invite, request.POST if request.method == "POST" else None)
    if form.is_valid():
        try:
            user = services.invite_accept(
                token=token,
                username=form.cleaned_data["username"],
                password=form.cleaned_data["password1"],
            )
        except services.InviteError as err:  # used, or expired, since the form was shown
            return _invite_refused(request, err)
        except services.UserCreateError as err:
            form.add_error(None, str(err))
        else:
            login(request, user, backend=SIGN_IN_BACKEND)
            messages.success(request, f"Welcome, {user.get_username()}: your account is ready.")
            return redirect(settings.LOGIN_REDIRECT_URL)
    status = 422 if form.is_bound else 200
    context = {"form": form, "invite": invite}
    response = render(request, "accounts/invite_accept.html", context, status=status)
    response["Cache-Control"] = "no-store"
    return response
