"""API routes: OpenAI-compatible, the seed proxy's shapes, rerank, tokenize, models, usage, jobs."""

from django.urls import path

from embeddings.api import batches, cohere_embed, files, jobs, rerank, tokenize, usage, views

urlpatterns = [
    path("v1/embeddings", views.OpenAIEmbeddingsView.as_view(), name="openai-embeddings"),
    path("v1/embedding", views.SeedEmbeddingView.as_view(), name="seed-embedding"),
    path("api/v1/embed", views.TeiEmbedView.as_view(), name="tei-embed"),
    path("embed", views.TeiEmbedShortView.as_view(), name="tei-embed-short"),
    path("v2/embed", cohere_embed.CohereEmbedView.as_view(), name="cohere-embed"),
    path("v2/rerank", rerank.CohereRerankView.as_view(), name="cohere-rerank"),
    path("v1/rerank", rerank.RerankView.as_view(), name="rerank"),
    path("rerank", rerank.TeiRerankView.as_view(), name="tei-rerank"),
    path("tokenize", tokenize.TeiTokenizeView.as_view(), name="tei-tokenize"),
    path("decode", tokenize.TeiDecodeView.as_view(), name="tei-decode"),
    path("v1/models", views.ModelListView.as_view(), name="models"),
    # Model ids may contain "/" (e.g. sentence-transformers/all-MiniLM-L6-v2).
    path("v1/models/<path:model_id>", views.ModelDetailView.as_view(), name="model-detail"),
    path("v1/usage", usage.UsageView.as_view(), name="usage"),
    path("v1/jobs", jobs.JobListCreateView.as_view(), name="jobs"),
    path("v1/jobs/<str:job_id>", jobs.JobDetailView.as_view(), name="job-detail"),
    path("v1/jobs/<str:job_id>/cancel", jobs.JobCancelView.as_view(), name="job-cancel"),
    path("v1/jobs/<str:job_id>/results", jobs.JobResultsView.as_view(), name="job-results"),
    path("v1/files", files.FileListCreateView.as_view(), name="files"),
    path("v1/files/<str:file_id>", files.FileDetailView.as_view(), name="file-detail"),
    path("v1/files/<str:file_id>/content", files.FileContentView.as_view(), name="file-content"),
    path("v1/batches", batches.BatchListCreateView.as_view(), name="batches"),
    path("v1/batches/<str:batch_id>", batches.BatchDetailView.as_view(), name="batch-detail"),
    path("v1/batches/<str:batch_id>/cancel", batches.BatchCancelView.as_view(), name="batch-cancel"),
]
