"""HTTP API: views, serializers, authentication and error rendering."""
