"""The controller's third mode: a fidelity target (mean KL to full prefill) the measured ratio
curve turns into the least recompute ratio."""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("dashboard", "0001_initial")]

    operations = [
        migrations.AlterField(
            model_name="dashboardsettings",
            name="controller_mode",
            field=models.CharField(
                choices=[
                    ("auto", "Auto (the worker's loading controller decides)"),
                    ("fixed", "Fixed ratio"),
                    ("target", "Fidelity target (the measured curve gives the ratio)"),
                ],
                default="auto",
                max_length=8,
            ),
        ),
        migrations.AddField(
            model_name="dashboardsettings",
            name="fidelity_target",
            field=models.FloatField(
                blank=True, null=True, validators=[django.core.validators.MinValueValidator(0.0)]
            ),
        ),
        migrations.RemoveConstraint(
            model_name="dashboardsettings", name="dashboard_fixed_mode_has_ratio"
        ),
        migrations.AddConstraint(
            model_name="dashboardsettings",
            constraint=models.CheckConstraint(
                condition=~models.Q(controller_mode="fixed")
                | models.Q(fixed_recompute_ratio__isnull=False),
                name="dashboard_fixed_mode_has_ratio",
            ),
        ),
        migrations.AddConstraint(
            model_name="dashboardsettings",
            constraint=models.CheckConstraint(
                condition=~models.Q(controller_mode="target") | models.Q(fidelity_target__gte=0.0),
                name="dashboard_target_mode_has_target",
            ),
        ),
    ]
