from django.urls import path

from jobs import views_costs

urlpatterns = [
    path("", views_costs.overview, name="cost-overview"),
    path("jobs/", views_costs.jobs, name="cost-jobs"),
    path("jobs.csv", views_costs.jobs_csv, name="cost-jobs-csv"),
    path("rollup.csv", views_costs.rollup_csv, name="cost-rollup-csv"),
]
