"""For mypy only: the stand-ins import their siblings flat (`import safetensors_check`), as the image installs
them (all in /usr/local/lib/standin); a module has one name in a mypy run, so this stub gives the flat name the
package module's types."""

from testbed.standin.safetensors_check import *  # noqa: F403 - all of it, under the flat name
