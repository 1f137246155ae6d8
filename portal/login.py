"""Login: throttling and lockout (django-axes, configured in settings), the audit of failed
and locked-out logins, and the password reset pages (Django's, mailed through the mail
backend: the console on the embedded default)."""

import math

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth import views as auth_views
from django.shortcuts import render
from django.urls import path, reverse_lazy

from portal.models import AuditEvent

USERNAME_MAX = 150


def audit_login(action: str, username: str, request) -> None:
    """A login event in the audit trail: no actor (nobody is signed in), the account as target."""
    username = str(username or "")[:USERNAME_MAX]
    user_id = get_user_model().objects.filter(username=username).values_list("pk", flat=True).first()
    address = request.META.get("REMOTE_ADDR", "") if request is not None else ""
    AuditEvent.objects.create(
        actor=None,
        action=action,
        target_type="auth.user",
        target_id=str(user_id or ""),
        detail={"username": username, "address": address},
    )


def login_failed(sender, credentials: dict, request=None, **kwargs) -> None:
    audit_login("login.failed", credentials.get("username", ""), request)


def login_locked_out(sender, request=None, username=None, ip_address=None, **kwargs) -> None:
    audit_login("login.locked_out", username or "", request)


def locked_out(request, original_response=None, credentials=None):
    """django-axes' answer to a login while its username and address are locked out."""
    minutes = math.ceil(settings.AXES_COOLOFF_TIME.total_seconds() / 60)
    response = render(
        request,
        "registration/login.html",
        {"locked_out": True, "lockout_minutes": minutes, "next": request.POST.get("next", "")},
        status=429,
    )
    response["Retry-After"] = str(int(settings.AXES_COOLOFF_TIME.total_seconds()))
    return response


def connect_signals() -> None:
    from axes.signals import user_locked_out
    from django.contrib.auth.signals import user_login_failed

    user_login_failed.connect(login_failed, dispatch_uid="hangar.audit.login_failed")
    user_locked_out.connect(login_locked_out, dispatch_uid="hangar.audit.login_locked_out")


password_reset_urls = [
    path(
        "password-reset/",
        auth_views.PasswordResetView.as_view(success_url=reverse_lazy("password_reset_done")),
        name="password_reset",
    ),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path(
        "password-reset/<uidb64>/<token>/",
        auth_views.PasswordResetConfirmView.as_view(success_url=reverse_lazy("password_reset_complete")),
        name="password_reset_confirm",
    ),
    path("password-reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
]
