"""A job's kind (embeddings/services/jobs/kinds.py), saved with it: the engine asks the kind how to
embed its chunks instead of looking for a batch. Jobs that run a batch become the kind "batch"."""

from django.db import migrations, models


def batch_jobs_are_of_the_batch_kind(apps, schema_editor):
    EmbeddingJob = apps.get_model("embeddings", "EmbeddingJob")
    EmbeddingJob.objects.filter(batch__isnull=False).update(kind="batch")


class Migration(migrations.Migration):
    dependencies = [("embeddings", "0008_openai_files_batches")]

    operations = [
        migrations.AddField(
            model_name="embeddingjob",
            name="kind",
            field=models.CharField(
                default="embeddings",
                editable=False,
                help_text="How its chunks are embedded (settings.JOB_KINDS): embeddings, or a batch's lines",
                max_length=32,
            ),
        ),
        migrations.RunPython(batch_jobs_are_of_the_batch_kind, migrations.RunPython.noop),
    ]
