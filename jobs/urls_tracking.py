from django.urls import path

from jobs import trackingproxy

# MLflow's client appends api/2.0/mlflow/<endpoint> to MLFLOW_TRACKING_URI (…/api/mlflow).
urlpatterns = [
    path("api/2.0/mlflow/<path:name>", trackingproxy.mlflow_api, name="tracking-proxy"),
]
