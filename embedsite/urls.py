"""Top-level URL routes."""

from django.urls import path

from embeddings.api import views

urlpatterns = [
    path("health", views.health, name="health"),
]
