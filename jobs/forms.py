import shlex

from django import forms
from django.conf import settings

from fleet.models import Node
from jobs.models import Environment, priority_classes
from portal.models import Project, Role


class SecretTextarea(forms.Textarea):
    def format_value(self, value) -> str:
        return ""  # secrets are never shown back, not even when the form comes back with an error


class JobForm(forms.Form):
    """The browser's view of a submission. It only turns text into the API's
    shape; the API serializer validates, so both refuse the same things."""

    name = forms.CharField(max_length=200, required=False, help_text="Defaults to the program's name.")
    project = forms.ChoiceField()
    command = forms.CharField(
        widget=forms.TextInput(attrs={"placeholder": "python train.py --epochs 3", "class": "mono"}),
        help_text="Split like a shell line (quotes group words) and run as an argv list, never through a shell.",
    )
    gpus_per_node = forms.IntegerField(label="GPUs per node", initial=1)
    nodes = forms.IntegerField(
        initial=1, required=False, help_text="More than one: one rank per node, all started at once."
    )
    gpu_type = forms.ChoiceField(label="GPU type", required=False)
    priority = forms.ChoiceField(required=False, help_text="Blank: the project's default class.")
    environment = forms.ChoiceField(required=False)
    max_retries = forms.IntegerField(
        label="Retries", initial=0, required=False, help_text="Times to run it again if the command itself fails."
    )
    stop_on_hang = forms.BooleanField(
        label="Stop on a suspected hang",
        required=False,
        help_text="End the attempt when a rank stays silent while the others print (HANGAR_HANG_SECONDS).",
    )
    max_runtime_seconds = forms.IntegerField(
        label="Max runtime (seconds)",
        initial=settings.HANGAR_DEFAULT_MAX_RUNTIME_SECONDS,
        help_text="The job is stopped after this long (3600 = one hour).",
    )
    env = forms.CharField(
        label="Environment variables",
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "KEY=value, one per line", "class": "mono"}),
    )
    secret_env = forms.CharField(
        label="Secret variables",
        required=False,
        widget=SecretTextarea(attrs={"rows": 2, "placeholder": "KEY=value, one per line", "class": "mono"}),
        help_text="Given to the job, never shown again (masked on the job page and in the API).",
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].choices = [(p.slug, p.name) for p in Project.objects.with_role(user, Role.MEMBER)]
        types = sorted(set(Node.objects.values_list("gpu_model", flat=True)))
        self.fields["gpu_type"].choices = [("", "any")] + [(t, t) for t in types]
        self.fields["priority"].choices = [("", "project default")] + [(n, n) for n in priority_classes()]
        envs = Environment.objects.values_list("name", "description")
        self.fields["environment"].choices = [("", "host (none)")] + [(n, f"{n}: {d}" if d else n) for n, d in envs]

    def clean_command(self) -> list[str]:
        try:
            return shlex.split(self.cleaned_data["command"])
        except ValueError as exc:
            raise forms.ValidationError(f"cannot split this line ({exc}); check the quotes")

    def clean_env(self) -> dict[str, str]:
        return parse_env(self.cleaned_data["env"])

    def clean_secret_env(self) -> dict[str, str]:
        return parse_env(self.cleaned_data["secret_env"])

    def api_data(self) -> dict:
        data = dict(self.cleaned_data)
        return {key: value for key, value in data.items() if value not in ("", None)}

    def add_api_errors(self, errors: dict) -> None:
        for field, messages in errors.items():
            target = field if field in self.fields else None  # the API's names are the form's
            for message in messages if isinstance(messages, list) else [messages]:
                text = str(message) if not isinstance(message, dict) else "; ".join(map(str, message.values()))
                self.add_error(target, text)


def parse_env(text: str) -> dict[str, str]:
    env = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise forms.ValidationError(f"line {number} is not KEY=value")
        env[key.strip()] = value
    return env
