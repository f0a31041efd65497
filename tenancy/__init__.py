"""kvgate tenancy: tenants, API keys, quotas and the usage ledger in a store (SQLite by default, PostgreSQL by
URL), the rate limiters (in process, or shared through Redis), and the ``kvgatectl`` admin CLI. Imported by the
gateway; never imports ``workers`` or torch (docs/ARCHITECTURE.md)."""
