"""The one exception type for user errors: the CLI prints its message as one line."""


class KvjaxError(Exception):
  """A problem with the user's input (config, prompt, file) whose message names the fix."""
