"""OpenAI's Files and Batches APIs: files, batches, their lines and output, and the runner that runs them."""
