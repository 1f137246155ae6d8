"""Notification subscriptions and their delivery logs: each user's own, nobody else's."""

from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from jobs.models import Channel, Delivery, Event, Subscription
from jobs.models.notify import url_problem
from portal.models import Project


class SubscriptionSerializer(serializers.ModelSerializer):
    project = serializers.SlugField(
        required=False, allow_null=True, help_text="Blank: the jobs you submitted, in any project."
    )
    events = serializers.ListField(child=serializers.ChoiceField(Event.choices), allow_empty=False)
    channel = serializers.ChoiceField(Channel.choices, default=Channel.WEBHOOK)

    class Meta:
        model = Subscription
        fields = ["id", "project", "events", "channel", "url", "email", "active", "created_at", "secret"]
        read_only_fields = ["id", "created_at", "secret"]

    def to_representation(self, sub):
        data = super().to_representation(sub)
        data["project"] = sub.project.slug if sub.project_id else None
        if not self.context.get("show_secret"):
            data.pop("secret")  # shown once, when created: it signs the webhook bodies
        return data

    def validate_project(self, slug):
        if slug is None:
            return None
        project = Project.objects.visible_to(self.context["request"].user).filter(slug=slug).first()
        if project is None:
            raise serializers.ValidationError(f"no project {slug!r} among yours: give the slug of one you belong to")
        return project

    def validate(self, data):
        channel = data.get("channel", getattr(self.instance, "channel", Channel.WEBHOOK))
        url = data.get("url", getattr(self.instance, "url", ""))
        changed = self.instance is None or {"url", "channel"} & data.keys()
        if changed and (problem := url_problem(channel, url)):
            raise serializers.ValidationError({"url": problem})
        return data


class DeliverySerializer(serializers.ModelSerializer):
    # Plain text: the same choices under a second name would give the schema two enums for one set.
    event = serializers.CharField(read_only=True, help_text="One of the subscription's events.")

    class Meta:
        model = Delivery
        fields = ["id", "event", "state", "tries", "next_try_at", "created_at", "delivered_at", "log", "payload"]


class SubscriptionViewSet(viewsets.ModelViewSet):
    serializer_class = SubscriptionSerializer
    queryset = Subscription.objects.none()  # for the schema; requests use get_queryset
    lookup_value_regex = r"\d+"

    def get_queryset(self):
        return Subscription.objects.visible_to(self.request.user).select_related("project")

    def get_serializer_context(self):
        return {**super().get_serializer_context(), "show_secret": self.action == "create"}

    def perform_create(self, serializer):
        serializer.save(user=self.request.user)

    @action(detail=True, methods=["get"], serializer_class=DeliverySerializer)
    def deliveries(self, request, pk=None):
        """The latest 100 deliveries of this subscription: each try's status, error and time."""
        sub = self.get_object()
        return Response(DeliverySerializer(sub.deliveries.all()[:100], many=True).data)
