"""OpenAI's contracts: the Files API, the Batch API (a job kind of the job engine), its request
and output lines, and the body of an embeddings answer.

Imports the jobs, inference and quotas wings."""
