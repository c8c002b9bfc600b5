from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("embeddings", "0018_job_newest_first_index"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="usagebucket",
            index=models.Index(fields=["hour"], name="usage_bucket_hour"),
        ),
    ]
