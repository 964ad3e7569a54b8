"""A Hugging Face Hub id as a reader: its splits as the Hub lists them, loaded or streamed by
`datasets`."""

from __future__ import annotations

import os

import datasets

from vitcli.data.rows.reader import Reader
from vitcli.errors import DataError, first_line

_TRUE = ("1", "on", "yes", "true")


class HubReader(Reader):
    """`owner/name` or `name` on the Hub; refused at once when the Hub is switched off."""

    local = False

    def splits(self) -> list[str]:
        check_online(self.source)
        try:
            return list(datasets.get_dataset_split_names(self.source))
        except Exception as e:  # noqa: BLE001 - network, auth, no such dataset: the library's words, one line
            reason = first_line(e)
            raise DataError(f"cannot list the splits of '{self.source}' on the Hub: {reason}") from None

    def load(self, split: str) -> datasets.Dataset:
        return self._open(split, streaming=False)

    def stream(self, split: str) -> datasets.IterableDataset:
        return self._open(split, streaming=True)

    def _open(self, split: str, streaming: bool):
        check_online(self.source)
        try:
            return datasets.load_dataset(self.source, split=split, streaming=streaming)
        except Exception as e:  # noqa: BLE001 - network, auth, unknown split: the library's words, one line
            verb = "stream" if streaming else "load"
            raise DataError(f"cannot {verb} '{self.source}' split '{split}' from the Hub: "
                            f"{first_line(e)}") from None


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def offline() -> bool:
    """HF_DATASETS_OFFLINE or HF_HUB_OFFLINE set to a true value."""
    return any(os.environ.get(k, "").lower() in _TRUE for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def check_online(source: str) -> None:
    if offline():
        raise DataError(
            f"dataset '{source}' is not a local path and the Hub is offline (HF_DATASETS_OFFLINE or "
            "HF_HUB_OFFLINE is set); give a local directory or file, or unset them"
        )
