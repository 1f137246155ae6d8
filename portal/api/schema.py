"""What drf-spectacular needs to describe Hangar's own pieces in the OpenAPI schema."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.auth.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (`hgr_...`) from the API tokens page, `POST /api/v1/tokens/` "
            "or `manage.py create_token`.",
        }
