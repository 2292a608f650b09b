"""The one error a download raises: a message for the pod log, naming the URI."""


class FetchError(RuntimeError):
    """The model could not be fetched; the message says what and what to do."""
