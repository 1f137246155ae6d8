"""The notifications page: the user's subscriptions, a form to add one, and how deliveries went."""

from django import forms
from django.shortcuts import render

from jobs.models import Channel, Delivery, Event, Subscription
from jobs.models.notify import url_problem
from portal.models import Project


class SubscriptionForm(forms.Form):
    events = forms.MultipleChoiceField(choices=Event.choices, widget=forms.CheckboxSelectMultiple)
    project = forms.ModelChoiceField(
        queryset=Project.objects.none(), required=False, empty_label="The jobs I submit", to_field_name="slug"
    )
    channel = forms.ChoiceField(choices=Channel.choices, initial=Channel.WEBHOOK)
    url = forms.URLField(
        max_length=500, required=False, assume_scheme="https", help_text="Where webhooks are POSTed: a public address."
    )
    email = forms.EmailField(required=False, help_text="E-mail: blank sends to your own address.")

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = Project.objects.visible_to(user)

    def clean(self):
        data = super().clean()
        # The API's check, word for word (jobs.models.notify.url_problem).
        if "url" not in self.errors and (problem := url_problem(data.get("channel", ""), data.get("url", ""))):
            self.add_error("url", problem)
        return data


def notifications(request):
    """A new subscription's secret (it signs the webhook bodies) is shown once, on this response only."""
    form = SubscriptionForm(request.user, request.POST or None)
    made = None
    if request.method == "POST" and form.is_valid():
        made = Subscription.objects.create(user=request.user, **form.cleaned_data)
        form = SubscriptionForm(request.user)
    subs = Subscription.objects.visible_to(request.user).select_related("project")
    deliveries = Delivery.objects.filter(subscription__in=subs).select_related("subscription")[:100]
    context = {"subscriptions": subs, "deliveries": deliveries, "form": form, "made": made}
    return render(request, "jobs/notifications.html", context)
