"""The one exception type for user errors: the CLI prints its message as one line.

`ArgError` is one bad argument of a library call, said with the argument's keyword
(`max_new_tokens`), which is what a Python caller wrote; a face that names arguments its
own way renders it with that name (the CLI with its flag, `--max-new-tokens`: `flag`).
"""


class KvjaxError(Exception):
  """A problem with the user's input (config, prompt, file) whose message names the fix."""


class ArgError(KvjaxError):
  """A bad value of the argument `arg`: `template` holds `{arg}` wherever it is named;
  `cli`, where the command line says it otherwise than by renaming one argument (its
  `--prompt` and `--prompt-ids` are one `prompt` in Python), is the command line's line."""

  def __init__(self, arg: str, template: str, cli: str | None = None):
    self.arg, self.template, self.cli = arg, template, cli
    super().__init__(self.named(arg))

  def named(self, name: str) -> str:
    """The message with the argument called `name`."""
    return self.template.replace("{arg}", name)

  def on_command_line(self) -> str:
    return self.cli or self.named(flag(self.arg))


def flag(arg: str) -> str:
  """The command line's name of a keyword argument: `max_new_tokens` -> `--max-new-tokens`."""
  return "--" + arg.replace("_", "-")


def as_arg(arg: str, check, *args) -> None:
  """Run `check(name, *args)`, a check that names what it checks by `name`, as the argument
  `arg`: its refusal becomes an `ArgError`."""
  try:
    check("{arg}", *args)
  except ArgError:
    raise
  except KvjaxError as e:
    raise ArgError(arg, str(e)) from None
