from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("chat", "0010_message_total_seen_s"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="parts_not_found",
            field=models.JSONField(blank=True, default=list),
        ),
    ]
