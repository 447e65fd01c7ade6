from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("chat", "0009_message_verdict_and_ttft_seen"),
    ]

    operations = [
        migrations.AddField(
            model_name="message",
            name="total_seen_s",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
