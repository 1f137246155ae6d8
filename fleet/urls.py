from django.urls import path

from fleet import views

urlpatterns = [
    path("", views.fleet, name="fleet"),
    path("nodes/<slug:name>/", views.node_detail, name="fleet-node"),
    path("nodes/<slug:name>/action/", views.node_action, name="fleet-node-action"),
]
