"""Login throttling and lockout (django-axes), the audit of failed logins, Django's
password validators and the password reset flow through the mail backend."""

import re

import pytest
from django.contrib.auth.password_validation import validate_password
from django.core import mail
from django.core.exceptions import ValidationError
from django.test import Client

from portal.models import AuditEvent
from tests.factories import make_user


def login(client: Client, username: str, password: str):
    return client.post("/login/", {"username": username, "password": password})


@pytest.mark.django_db
def test_wrong_passwords_lock_the_account_out_even_for_the_right_one(settings):
    make_user("victim")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert login(client, "victim", "guess").status_code == 200  # the form again, with its error
    assert login(client, "victim", "guess").status_code == 429  # the last failure allowed locks
    locked = login(client, "victim", "pw-victim")
    assert locked.status_code == 429
    assert int(locked["Retry-After"]) > 0
    assert b"Too many failed logins" in locked.content
    assert "_auth_user_id" not in client.session


@pytest.mark.django_db
def test_a_success_before_the_limit_resets_the_count(settings):
    make_user("forgetful")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "forgetful", "guess")
    assert login(client, "forgetful", "pw-forgetful").status_code == 302
    client.logout()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        login(client, "forgetful", "guess")
    assert login(client, "forgetful", "pw-forgetful").status_code == 302


@pytest.mark.django_db
def test_failed_and_locked_out_logins_are_audited(settings):
    user = make_user("audited")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        login(client, "audited", "guess")
    failed = AuditEvent.objects.filter(action="login.failed")
    assert failed.count() == settings.AXES_FAILURE_LIMIT
    assert {(e.target_id, e.detail["username"], e.detail["address"]) for e in failed} == {
        (str(user.pk), "audited", "127.0.0.1")
    }
    assert AuditEvent.objects.filter(action="login.locked_out", target_id=str(user.pk)).exists()
    login(client, "nobody-here", "guess")
    assert AuditEvent.objects.filter(action="login.failed", target_id="", detail__username="nobody-here").exists()


@pytest.mark.parametrize("password", ["short1!", "password123", "1234567890123", "alicealice1"])
def test_weak_passwords_are_refused(password):
    from django.contrib.auth.models import User

    with pytest.raises(ValidationError):
        validate_password(password, User(username="alicealice1"))


def test_the_embedded_default_mails_to_the_console():
    from portal import settings as defaults

    assert defaults.EMAIL_BACKEND == "django.core.mail.backends.console.EmailBackend"


@pytest.mark.django_db
def test_a_password_reset_mails_a_link_that_sets_a_validated_password():
    make_user("resetter", email="resetter@example.com")
    client = Client()
    assert client.get("/password-reset/").status_code == 200
    assert client.post("/password-reset/", {"email": "resetter@example.com"}).status_code == 302
    assert len(mail.outbox) == 1
    link = re.search(r"http://testserver(/password-reset/\S+/)", mail.outbox[0].body).group(1)
    form = client.get(link, follow=True)
    assert form.status_code == 200 and b"new_password1" in form.content
    confirm = form.redirect_chain[-1][0]
    weak = client.post(confirm, {"new_password1": "12345678", "new_password2": "12345678"})
    assert weak.status_code == 200 and b"error" in weak.content
    strong = client.post(confirm, {"new_password1": "taxi-orbit-violet-42", "new_password2": "taxi-orbit-violet-42"})
    assert strong.status_code == 302
    assert login(Client(), "resetter", "taxi-orbit-violet-42").status_code == 302


@pytest.mark.django_db
def test_an_unknown_address_sends_nothing_and_says_the_same():
    response = Client().post("/password-reset/", {"email": "nobody@example.com"})
    assert response.status_code == 302 and mail.outbox == []
