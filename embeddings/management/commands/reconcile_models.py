"""Load the catalog's models into the running Triton and print each one's state."""

from django.core.management.base import BaseCommand

from embeddings.services.inference.serving import write_serving_states


class Command(BaseCommand):
    help = (
        "Load every catalog model into the configured Triton, as runstack does once Triton is ready, "
        "and print each model's state; a model that cannot load is reported, not fatal."
    )

    def handle(self, *args, **options):
        write_serving_states(self.stdout)
