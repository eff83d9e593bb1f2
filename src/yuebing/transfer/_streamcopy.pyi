from typing_extensions import Buffer

STREAMING: int

def copy(dst: Buffer, src: Buffer, /) -> None: ...
