"""A minimal Django project for tests/integration/test_django.py: one app, one model, settings
made from a test's database URL (`settings.for_database`)."""
