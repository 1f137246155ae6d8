"""The notifications page: the user's subscriptions and how their deliveries went."""

from django.shortcuts import render

from jobs.models import Delivery, Subscription


def notifications(request):
    subs = Subscription.objects.visible_to(request.user).select_related("project")
    deliveries = Delivery.objects.filter(subscription__in=subs).select_related("subscription")[:100]
    return render(request, "jobs/notifications.html", {"subscriptions": subs, "deliveries": deliveries})
