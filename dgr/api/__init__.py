"""The HTTP faces of dgr: the OpenAI API, errors as JSON, streaming text."""
