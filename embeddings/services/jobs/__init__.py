"""The asynchronous job engine: a job's inputs are cut into chunks that Celery tasks embed, each
once, under leases, with usage counted once and the job's tokens settled at its end.

`submission` admits and stores a job, `engine` runs its chunks and ends it, `reads` is what the
API shows of jobs; `store` holds a job's data in the job store (Redis), `budget` the bytes jobs may
hold there; `leases`, `events`, `callbacks` (and where one may go: `callback_targets`),
`inputs`, `results`, `backlog`.

The engine knows job kinds, not the APIs built on it: a kind (`kinds`) says how its chunks are
embedded and what happens at its end; OpenAI's Batch API is one, registered by the openai_api
wing. Imports the inference, quotas and accounts wings, never openai_api."""
