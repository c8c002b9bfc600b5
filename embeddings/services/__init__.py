"""Business logic shared by views, tasks and management commands."""
