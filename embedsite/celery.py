"""The Celery application; tasks are discovered from the installed apps."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")

app = Celery("embedsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Logging as Django's LOGGING says, tracing when OTEL_* asks, request ids carried by tasks.
from embeddings.observability import celery_hooks  # noqa: E402, F401
