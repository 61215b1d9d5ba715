"""``python -m dsv41_jax.convert SRC DST``: an official DeepSeek safetensors checkpoint (``SRC``:
config.json + index + shards, or one ``.safetensors`` with ``--config``) to an Orbax checkpoint
(``DST``) that :func:`dsv41_jax.checkpoint.restore_params` restores onto any mesh.

Quantized tensors keep their formats; Engram tables are streamed from the source memmaps to
host ``.npy`` files. With several devices the other leaves are spread over all of them while
converting. Errors are one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="official checkpoint directory (config.json + safetensors)")
    ap.add_argument("dst", help="output Orbax checkpoint directory (must not exist unless --overwrite)")
    ap.add_argument("--config", help="config.json to use instead of SRC/config.json")
    ap.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)

    from .checkpoint import CheckpointError, load_checkpoint, save_params
    from .checkpoint.orbax_io import default_shardings
    from .config import ConfigError, ModelConfig

    try:
        import jax

        t0 = time.time()
        if os.path.exists(a.dst) and not a.overwrite:
            raise CheckpointError(f"{a.dst} already exists (use --overwrite)")
        cfg = ModelConfig.from_json(a.config) if a.config else None
        shardings = None
        if jax.device_count() > 1:
            mesh = jax.make_mesh((jax.device_count(),), ("x",))
            shardings = default_shardings(mesh)
        cfg, params = load_checkpoint(a.src, cfg, shardings=shardings)
        save_params(params, a.dst, cfg, overwrite=a.overwrite)
        if not a.quiet:
            print(f"wrote {a.dst} ({time.time() - t0:.1f} s)")
        return 0
    except (CheckpointError, ConfigError, OSError, ValueError) as e:
        msg = " ".join(str(e).split())
        print(f"error: {msg}", file=sys.stderr)
        return 1
    except Exception as e:  # anything else: still one line, with the exception type
        msg = " ".join(str(e).split())
        print(f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted (no output checkpoint was completed)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
