"""kvgate tenancy: tenants, API keys, quotas and the usage ledger in a store (SQLite by default, PostgreSQL by
URL), the rate limiters (in process, or shared through Redis), and the admin operations that the gateway's admin
API and the operator console (``console/``: ``kvgatectl``) both call. Imported by the gateway and the console;
never imports either of them, ``workers`` or torch (docs/ARCHITECTURE.md)."""
