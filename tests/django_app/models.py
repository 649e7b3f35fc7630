"""The business row that a message announces."""

from __future__ import annotations

from django.db import models


class Order(models.Model):  # type: ignore[misc]  # Django ships no type hints
    id = models.IntegerField(primary_key=True)
    status = models.CharField(max_length=20)

    class Meta:
        app_label = "django_app"
        db_table = "django_orders"
