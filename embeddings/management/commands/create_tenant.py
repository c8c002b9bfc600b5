"""Create a tenant from the shell."""

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError, transaction

from embeddings.models import Tenant
from embeddings.services.accounts.tenants import quota_limits_update, tenant_create


class Command(BaseCommand):
    help = (
        "Create a tenant: create_tenant --name 'Acme' [--slug acme] "
        "[--requests-per-second 80 --request-burst 50 --tokens-per-minute 150000 ...] "
        "[--job-storage-budget-bytes 2147483648]"
    )

    def add_arguments(self, parser):
        parser.add_argument("--name", required=True)
        parser.add_argument("--slug", default=None)
        for field in Tenant.QUOTA_FIELDS:
            parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=None, dest=field)
        parser.add_argument(
            "--job-storage-budget-bytes",
            type=int,
            default=None,
            help="Bytes its jobs may hold in the job store at once; default JOB_STORAGE_TENANT_BUDGET_BYTES",
        )

    def handle(self, *args, name, slug, job_storage_budget_bytes, **options):
        limits = {field: options[field] for field in Tenant.QUOTA_FIELDS if options[field] is not None}
        try:
            with transaction.atomic():
                tenant = tenant_create(
                    name=name, slug=slug, job_storage_budget_bytes=job_storage_budget_bytes
                )
                if limits:
                    quota_limits_update(owner=tenant, limits=limits)
        except (IntegrityError, ValueError, ValidationError) as error:
            raise CommandError(f"Cannot create tenant {name!r}: {error}") from error
        self.stdout.write(tenant.slug)
