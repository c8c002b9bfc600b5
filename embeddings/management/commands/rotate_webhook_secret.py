"""Create or rotate a tenant's webhook signing secret; the new secret is printed once, alone on stdout."""

from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError

from embeddings.models import Tenant
from embeddings.services.accounts.tenants import tenant_webhook_secret_rotate, webhook_secret_fingerprint

DEFAULT_OVERLAP_HOURS = 24.0


class Command(BaseCommand):
    help = (
        "Give a tenant a new webhook signing secret and print it (it is shown only this once). The "
        "previous secret keeps signing beside it for --overlap-hours (default 24; 0 after a leak)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="tenant slug")
        parser.add_argument(
            "--overlap-hours",
            type=float,
            default=DEFAULT_OVERLAP_HOURS,
            help="hours the previous secret still signs (a second v1); 0 stops it at once",
        )

    def handle(self, *args, tenant, overlap_hours, **options):
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise CommandError(f"No tenant with slug {tenant!r}")
        if not 0 <= overlap_hours <= 24 * 30:
            raise CommandError("--overlap-hours must be from 0 to 720")
        had_secret = bool(found.webhook_secret_encrypted)
        secret = tenant_webhook_secret_rotate(tenant=found, overlap=timedelta(hours=overlap_hours))
        if not had_secret:
            what = "new webhook secret"
        elif overlap_hours:
            until = found.webhook_previous_secret_expires_at
            what = f"rotated webhook secret (the previous one also signs until {until:%Y-%m-%d %H:%M} UTC)"
        else:
            what = "rotated webhook secret (the previous one no longer signs)"
        self.stderr.write(
            f"{what} for {found.slug}, fingerprint {webhook_secret_fingerprint(secret)} "
            "(store it now: it is not shown again):"
        )
        self.stdout.write(secret)
