"""What the service is doing now, for operators: `overview` gathers the models' state in Triton and
their last minutes of traffic, the busiest and most refused tenants, the job backlog and the Redis
servers' memory into one read for the admin's operations overview.

Reads only. Imports the accounts, quotas, inference and jobs wings, never openai_api."""
