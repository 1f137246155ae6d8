from django.urls import path

from jobs import views_notify

urlpatterns = [path("", views_notify.notifications, name="notifications")]
