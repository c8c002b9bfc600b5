"""Create a tenant from the shell."""

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError

from embeddings.services.tenants import tenant_create


class Command(BaseCommand):
    help = "Create a tenant: create_tenant --name 'Acme' [--slug acme]"

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True)
        parser.add_argument("--slug", default=None)

    def handle(self, *args, name, slug, **options):
        try:
            tenant = tenant_create(name=name, slug=slug)
        except (IntegrityError, ValueError) as error:
            raise CommandError(f"Cannot create tenant {name!r}: {error}") from error
        self.stdout.write(tenant.slug)
