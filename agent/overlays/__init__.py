"""Device-tree overlays for DVFS: OPP tables built, validated, compiled and installed.

Runtime DVFS can only choose among the operating points the device tree declares; changing
the points themselves (caps, undervolts) needs an overlay that the boot loader applies.

- ``socs``: the SoC facts (tables, labels, paths per kernel flavour, limits, stock tables)
- ``stock``: how far below stock and above the maximum a table may go (``--allow-*``)
- ``table``: YAML OPP tables and the checks every table passes; ``dts`` renders one
- ``dtc`` compiles, ``fdt`` reads a compiled overlay, ``check`` validates it read back
- ``build``: a table, a ``dts-overlays/`` entry or a file to a checked ``.dtbo``
- ``installer``: register/unregister with the boot loader; ``layouts`` finds which one
  (``armbian_env``, ``extlinux`` edit its config), ``bootfs`` writes below ``/boot`` only
"""
