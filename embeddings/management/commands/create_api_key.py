"""Create an API key from the shell; the full key is printed once, alone on stdout."""

from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from embeddings.models import Tenant
from embeddings.services.accounts.api_keys import api_key_create


class Command(BaseCommand):
    help = "Create an API key for a tenant and print it (it is shown only this once)."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument("--name", default="default")
        parser.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, *args, tenant, name, expires_in_days, **options):
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise CommandError(f"No tenant with slug {tenant!r}; create it with create_tenant")
        if expires_in_days is not None and expires_in_days < 1:
            raise CommandError("--expires-in-days must be at least 1")
        expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        _, secret = api_key_create(tenant=found, name=name, expires_at=expires_at)
        self.stderr.write(f"API key for {found.slug} (store it now: it is not shown again):")
        self.stdout.write(secret)
