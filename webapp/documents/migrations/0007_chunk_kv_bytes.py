from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("documents", "0006_plain_stage_labels"),
    ]

    operations = [
        migrations.AddField(
            model_name="chunk",
            name="kv_bytes",
            field=models.PositiveBigIntegerField(default=0),
        ),
    ]
