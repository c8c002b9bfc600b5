"""Top-level URL routes."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from embeddings.admin_overview import operations_overview_view
from embeddings.api import health, metrics_export
from embeddings.errors.answers import json_not_found, json_server_error

urlpatterns = [
    path("", include("embeddings.api.urls")),
    path("health", health.health, name="health"),
    path("ready", health.ready, name="ready"),
    # Sums the worker processes' values when PROMETHEUS_MULTIPROC_DIR is set (runstack sets it).
    path("metrics", metrics_export.metrics, name="prometheus-django-metrics"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("explorer/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    # Our template drops the stock one's Google Fonts links: the docs work offline.
    path(
        "redoc/",
        SpectacularRedocView.as_view(url_name="schema", template_name="api_docs/redoc.html"),
        name="redoc",
    ),
    # An admin page of no model: staff only, as every admin view (embeddings/admin_overview.py).
    path("admin/operations/", operations_overview_view, name="admin-operations-overview"),
    path("admin/", admin.site.urls),
]

handler404 = json_not_found
handler500 = json_server_error
