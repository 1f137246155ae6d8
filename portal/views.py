from django import forms
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from portal.models import LIMIT_FIELDS, ApiToken, Project


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What uses it, e.g. 'laptop CLI' or 'sweep agent'.")
    project = forms.ModelChoiceField(
        queryset=Project.objects.none(), required=False, empty_label="All my projects", to_field_name="slug"
    )
    read_only = forms.BooleanField(required=False, help_text="Can read jobs, logs and nodes, never change anything.")
    # Limits on the jobs submitted with it (jobs/tokenlimits.py); blank: none.
    max_running_jobs = forms.IntegerField(
        required=False, min_value=0, help_text="Unfinished jobs (queued or running) at once."
    )
    max_gpus = forms.IntegerField(required=False, min_value=0, help_text="GPUs its unfinished jobs hold at once.")
    max_gpu_hours_per_day = forms.DecimalField(
        required=False, min_value=0, max_digits=10, decimal_places=2, help_text="GPU-hours a UTC day."
    )
    max_spend_per_day = forms.DecimalField(
        required=False, min_value=0, max_digits=12, decimal_places=2, help_text="Spend a UTC day."
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = Project.objects.visible_to(user)


def tokens(request):
    """Create and revoke your API tokens; a new token's secret is shown once, on this response only."""
    form = TokenForm(request.user, request.POST or None)
    secret = None
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        limits = {name: data[name] for name in LIMIT_FIELDS}
        _, secret = ApiToken.issue(request.user, data["name"], data["project"], data["read_only"], **limits)
        form = TokenForm(request.user)
    mine = ApiToken.objects.filter(user=request.user).select_related("project").order_by("-created_at")
    return render(request, "portal/tokens.html", {"form": form, "tokens": mine, "secret": secret})


@require_POST
def revoke_token(request, pk: int):
    token = get_object_or_404(ApiToken, pk=pk, user=request.user)
    if token.revoke(request.user):
        messages.success(request, f"Token {token.name} revoked.")
    return redirect("tokens")
