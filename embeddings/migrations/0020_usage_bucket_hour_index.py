from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("embeddings", "0019_batch_file_admin_lists"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="usagebucket",
            index=models.Index(fields=["hour"], name="usage_bucket_hour"),
        ),
    ]
