"""Stand-ins: a tensor whose value is elsewhere, and the one rule it keeps — **a read of a resting weight's value
gets the value** (or a typed error), whatever code reads it.

Two things in memmode hold a tensor whose values are not where torch would read them: an offloaded parameter
or buffer at rest (its data a storage's placeholder, or a host copy an accelerator cannot compute with), and a
quantized layer's ``weight``, which does not exist at full precision. Both are *stand-ins*: the parameter keeps
its identity and its metadata, and everything that reads it — a parent module (``nn.MultiheadAttention``
reading ``out_proj.weight``), ``state_dict()`` and ``save_pretrained``, ``deepcopy``, ``torch.save``, a script
printing a weight — gets the real value. A forward computes with plain tensors (its group is onloaded first)
and pays nothing.

A stand-in meets four kinds of call, each handled by one module:

* **metadata** (shape, dtype, device, strides, ``data_ptr``, ``detach()``, ``*_like``): answered from the
  stand-in itself, free — :mod:`~.dispatch` (its tables say which calls these are);
* **a value read** (any other torch function): the stand-in is replaced by its value, asked of its
  :class:`~.classes.StandInSource` — :mod:`~.dispatch`, then the source: a runtime's resting slot (:mod:`~.slots`:
  onloaded into the running call, or read from the storage) or a quantized layer (:mod:`~.quantized`:
  dequantized). Every such read outside the forward that owns the weight is counted in the handle's report
  (``reads_served``), and refused under ``apply(..., strict=True)``
  (:class:`~memmode_core.contracts.errors.StandInReadError`);
* **a write** (``p.copy_(x)``, ``p.data += d``, ``p[...] = x``, ``out=p``, ``p.data = x``): carried through to
  what it stands in for by the source's ``write`` (:mod:`~.slots`: the tensor gets memory of its own and is
  stored again; :mod:`~.quantized`: dequantize, write, quantize again), or refused before anything changes —
  :mod:`~.dispatch` routes it;
* **a copy** (``copy.deepcopy``, pickling by ``torch.save``): a plain tensor or parameter holding the value —
  :mod:`~.values`, which also gives a stand-in's value to code outside a torch function and the typed errors.

The rest of the package: :mod:`~.classes` is what a stand-in is (the classes, which tensors rest as one, the
:class:`~.classes.StandInSource` and :class:`~.classes.StandInReader` every served read passes around);
:mod:`~.placeholders` catches a raw placeholder that reaches a computation all the same (the trap). The
engine's side — which tensors rest as stand-ins, counting and serving reads, learning who read them — is the
runtime's :class:`~memmode_core.engine.serving.Serving` part.

Importing this package imports :mod:`~.dispatch`, which sets the stand-in classes' hooks: no stand-in can exist
before (any module of the package is imported through this one).
"""

from memmode_core.engine.standins import dispatch  # noqa: F401 - sets the stand-in classes' hooks
