// needle.hal._blocks: the caching allocator's hot path (hal/allocator.py) in native code.
//
// Every op makes a result buffer and frees one, so an eager op's host time includes an
// allocation and a free. In Python they cost 1.4-2.3 us on an H100 host (a buffer object
// with a Python __init__ and __del__, two RLock round trips, the pool's dict and counters):
// more than a one-element `a + b`'s gap to PyTorch (docs/cuda_notes.md v23). Here the
// buffer is a C type (its fields read as fast as __slots__, its finalizer C code) and a
// pool's free lists and the allocator's counters are C++ state: 0.3-0.4 us for both.
//
// No lock: the module is built without free-threading support, so the GIL serializes
// every call, and nothing calls back into Python while the state is half-updated (a miss
// calls the allocator's `reserve` before touching anything; a closed pool's `release`
// comes last).
//
// Plain C-API types, not nanobind classes: a device's allocator lives until the process
// ends, and nanobind reports the instances of its classes still alive at shutdown as leaks.
//
// Types: BufferBase (hal/buffer.py's Buffer adds the Python methods), Ledger (the counters
// MemoryStats reports) and Pool (free blocks by size class; allocate; give back).
#include <nanobind/nanobind.h>

#include <structmember.h>

#include <algorithm>
#if defined(_MSC_VER)
#include <intrin.h>
#endif
#include <cstdint>
#include <new>
#include <unordered_map>
#include <vector>

namespace nb = nanobind;

namespace {

// ---- BufferBase ------------------------------------------------------------------------

struct BufferObject {
  PyObject_HEAD
  PyObject* handle;  // the backend's block: an int address (CUDA) or an object (MTLBuffer)
  long long offset;
  long long nbytes;
  long long capacity;  // the size class reserved; 0 for views and imported memory
  PyObject* pool;      // where the block returns when the buffer dies, or None
  PyObject* owner;     // what keeps a view's or an imported buffer's memory alive
  PyObject* weakrefs;
};

PyTypeObject* buffer_base = nullptr;
PyTypeObject* pool_type = nullptr;

void give_back(PyObject* pool, PyObject* handle, long long capacity);  // steals handle

int buffer_init(PyObject* obj, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"handle", "nbytes", "capacity", "pool", "offset", "owner",
                                nullptr};
  PyObject *handle, *pool = Py_None, *owner = Py_None;
  long long nbytes, capacity, offset = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLL|OLO:Buffer", const_cast<char**>(names),
                                   &handle, &nbytes, &capacity, &pool, &offset, &owner))
    return -1;
  auto* self = reinterpret_cast<BufferObject*>(obj);
  Py_INCREF(handle);
  Py_INCREF(pool);
  Py_INCREF(owner);
  Py_XSETREF(self->handle, handle);
  Py_XSETREF(self->pool, pool);
  Py_XSETREF(self->owner, owner);
  self->nbytes = nbytes;
  self->capacity = capacity;
  self->offset = offset;
  return 0;
}

// The collector sees only `owner` (a view's base buffer, an import's foreign object): the
// one field that can close a cycle. `handle` and `pool` never reference a buffer, and a
// buffer dying inside a garbage cycle must still find both intact in its finalizer, to
// return the block (were the handle visited, the collector could clear an MTLBuffer's
// Python wrapper first and the pool would then hand out a broken handle).
int buffer_traverse(PyObject* obj, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<BufferObject*>(obj)->owner);
  Py_VISIT(Py_TYPE(obj));  // heap types: instances keep their type alive
  return 0;
}

int buffer_clear(PyObject* obj) {
  Py_CLEAR(reinterpret_cast<BufferObject*>(obj)->owner);
  return 0;
}

// The finalizer: the block goes back to its pool (hal.buffer.Buffer.__del__ before).
void buffer_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<BufferObject*>(obj);
  PyTypeObject* type = Py_TYPE(obj);
  PyObject_GC_UnTrack(obj);
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(obj);
  PyObject* pool = self->pool;
  PyObject* handle = self->handle;
  self->pool = self->handle = nullptr;
  if (pool != nullptr && pool != Py_None && handle != nullptr) {
    give_back(pool, handle, self->capacity);  // takes the handle's reference
  } else {
    Py_XDECREF(handle);
  }
  Py_XDECREF(pool);
  Py_CLEAR(self->owner);
  type->tp_free(obj);
  Py_DECREF(type);  // a heap type: each instance held a reference
}

PyMemberDef buffer_members[] = {
    {"handle", T_OBJECT, offsetof(BufferObject, handle), 0, "the backend's block"},
    {"offset", T_LONGLONG, offsetof(BufferObject, offset), 0, "bytes into the block"},
    {"nbytes", T_LONGLONG, offsetof(BufferObject, nbytes), 0, "usable bytes"},
    {"capacity", T_LONGLONG, offsetof(BufferObject, capacity), 0,
     "the size class reserved (0: a view or imported memory)"},
    {"pool", T_OBJECT, offsetof(BufferObject, pool), 0, "where the block returns, or None"},
    {"owner", T_OBJECT, offsetof(BufferObject, owner), 0,
     "what keeps a view's or an import's memory alive"},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(BufferObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot buffer_slots[] = {
    {Py_tp_init, reinterpret_cast<void*>(buffer_init)},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(buffer_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(buffer_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(buffer_clear)},
    {Py_tp_members, buffer_members},
    {Py_tp_doc, const_cast<char*>("A range of device memory (fields; methods: hal.buffer).")},
    {0, nullptr}};

PyType_Spec buffer_spec = {"needle.hal._blocks.BufferBase", sizeof(BufferObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
                           buffer_slots};

// ---- Ledger: what MemoryStats reports, for one allocator and all its pools --------------

struct LedgerObject {
  PyObject_HEAD
  long long in_use, reserved, peak, hits, misses;
};

PyTypeObject* ledger_type = nullptr;

PyMemberDef ledger_members[] = {
    {"in_use", T_LONGLONG, offsetof(LedgerObject, in_use), 0, "bytes in live buffers"},
    {"reserved", T_LONGLONG, offsetof(LedgerObject, reserved), 0, "bytes held from the device"},
    {"peak", T_LONGLONG, offsetof(LedgerObject, peak), 0, "the highest in_use so far"},
    {"hits", T_LONGLONG, offsetof(LedgerObject, hits), READONLY, "requests served cached"},
    {"misses", T_LONGLONG, offsetof(LedgerObject, misses), READONLY, "requests not"},
    {nullptr, 0, 0, 0, nullptr}};

void ledger_dealloc(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  type->tp_free(obj);
  Py_DECREF(type);
}

PyType_Slot ledger_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(ledger_dealloc)},
    {Py_tp_members, ledger_members},
    {Py_tp_doc, const_cast<char*>("An allocator's counters (hal.allocator.MemoryStats).")},
    {0, nullptr}};

PyType_Spec ledger_spec = {"needle.hal._blocks.Ledger", sizeof(LedgerObject), 0,
                           Py_TPFLAGS_DEFAULT, ledger_slots};

// ---- Pool: free blocks by size class ---------------------------------------------------

long long size_class(long long nbytes) {
  constexpr long long kMin = 512;  // hal.allocator.MIN_BLOCK
  if (nbytes <= kMin) return kMin;
#if defined(_MSC_VER)
  unsigned long top;
  _BitScanReverse64(&top, static_cast<unsigned long long>(nbytes));
  int bits = static_cast<int>(top) + 1;
#else
  int bits = 64 - __builtin_clzll(static_cast<unsigned long long>(nbytes));
#endif
  long long step = 1LL << std::max(9, bits - 4);
  return (nbytes + step - 1) / step * step;
}

using FreeLists = std::unordered_map<long long, std::vector<PyObject*>>;  // owned references

struct PoolObject {
  PyObject_HEAD
  LedgerObject* ledger;
  PyObject* name;
  PyObject* reserve;             // reserve(capacity, nbytes) -> a new block (may raise)
  PyObject* release;             // release(handle, capacity): a block to the device
  PyTypeObject* buffer_type;     // hal.buffer.Buffer or a backend's subclass of it
  char is_private, closed, plain;  // plain: buffer_type has BufferBase's layout and __init__
  FreeLists* free;
};

// Pool.__new__ without __init__ leaves no state: refuse to use it rather than crash
bool ready(PoolObject* pool) {
  if (pool->free != nullptr) return true;
  PyErr_SetString(PyExc_RuntimeError, "this Pool was never initialized (Pool(ledger, ...))");
  return false;
}

PyObject* call_release(PoolObject* pool, PyObject* handle, long long capacity) {
  if (pool->release == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "this pool was cleared by the garbage collector");
    return nullptr;
  }
  return PyObject_CallFunction(pool->release, "OL", handle, capacity);
}

// A block comes back: cached, or (a closed pool) handed to the device. Steals handle.
int take_back(PoolObject* pool, PyObject* handle, long long capacity) {
  if (!ready(pool)) {
    Py_DECREF(handle);
    return -1;
  }
  pool->ledger->in_use -= capacity;
  if (!pool->closed) {
    (*pool->free)[capacity].push_back(handle);
    return 0;
  }
  PyObject* done = call_release(pool, handle, capacity);  // Python code may run here
  Py_DECREF(handle);
  Py_XDECREF(done);
  return done == nullptr ? -1 : 0;
}

PyObject* make_buffer(PoolObject* pool, PyObject* handle, long long nbytes,
                      long long capacity) {  // steals handle
  if (!pool->plain) {
    PyObject* buffer = PyObject_CallFunction(reinterpret_cast<PyObject*>(pool->buffer_type),
                                             "OLLO", handle, nbytes, capacity, pool);
    if (buffer == nullptr) take_back(pool, handle, capacity);
    else Py_DECREF(handle);
    return buffer;
  }
  PyObject* obj = pool->buffer_type->tp_alloc(pool->buffer_type, 0);  // zeroed, tracked
  if (obj == nullptr) {
    take_back(pool, handle, capacity);
    return nullptr;
  }
  auto* b = reinterpret_cast<BufferObject*>(obj);
  b->handle = handle;
  b->nbytes = nbytes;
  b->capacity = capacity;
  b->offset = 0;
  Py_INCREF(pool);
  b->pool = reinterpret_cast<PyObject*>(pool);
  Py_INCREF(Py_None);
  b->owner = Py_None;
  return obj;
}

// Pool.allocate(nbytes): a buffer of at least nbytes, from a cached block when one fits.
PyObject* pool_allocate(PyObject* obj, PyObject* arg) {
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  if (!ready(pool)) return nullptr;
  long long nbytes = PyLong_AsLongLong(arg);
  if (nbytes == -1 && PyErr_Occurred()) return nullptr;
  if (nbytes < 0) {
    PyErr_Format(PyExc_ValueError, "a buffer cannot have a negative size (%lld bytes)", nbytes);
    return nullptr;
  }
  long long capacity = size_class(nbytes);
  PyObject* handle = nullptr;
  auto it = pool->free->find(capacity);
  if (it != pool->free->end() && !it->second.empty()) {
    handle = it->second.back();  // the list's reference moves to the buffer
    it->second.pop_back();
    pool->ledger->hits++;
  } else {
    pool->ledger->misses++;
    if (pool->reserve == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "this pool was cleared by the garbage collector");
      return nullptr;
    }
    handle = PyObject_CallFunction(pool->reserve, "LL", capacity, nbytes);
    if (handle == nullptr) return nullptr;  // OutOfMemoryError, typically
  }
  LedgerObject* ledger = pool->ledger;
  ledger->in_use += capacity;
  ledger->peak = std::max(ledger->peak, ledger->in_use);
  return make_buffer(pool, handle, nbytes, capacity);
}

// Pool.give_back(handle, capacity): Buffer.release's way back.
PyObject* pool_give_back(PyObject* obj, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "give_back(handle, capacity) takes two arguments");
    return nullptr;
  }
  long long capacity = PyLong_AsLongLong(args[1]);
  if (capacity == -1 && PyErr_Occurred()) return nullptr;
  Py_INCREF(args[0]);
  if (take_back(reinterpret_cast<PoolObject*>(obj), args[0], capacity) < 0) return nullptr;
  Py_RETURN_NONE;
}

// Return every cached block to the device (the lists are emptied first: release may run
// Python code that frees more buffers into this pool).
int pool_empty_lists(PoolObject* pool) {
  if (!ready(pool)) return -1;
  FreeLists lists;
  lists.swap(*pool->free);
  int status = 0;
  for (auto& [capacity, handles] : lists) {
    for (PyObject* handle : handles) {
      PyObject* done = status == 0 ? call_release(pool, handle, capacity) : nullptr;
      if (done == nullptr) status = -1;  // the first error is kept; the rest are dropped
      Py_XDECREF(done);
      Py_DECREF(handle);
    }
  }
  return status;
}

PyObject* pool_empty(PyObject* obj, PyObject*) {
  if (pool_empty_lists(reinterpret_cast<PoolObject*>(obj)) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* pool_close(PyObject* obj, PyObject*) {
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  pool->closed = 1;
  if (pool_empty_lists(pool) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* pool_free(PyObject* obj, void*) {
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  if (!ready(pool)) return nullptr;
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  for (auto& [capacity, handles] : *pool->free) {
    if (handles.empty()) continue;
    PyObject* key = PyLong_FromLongLong(capacity);
    PyObject* count = PyLong_FromSize_t(handles.size());
    int bad = key == nullptr || count == nullptr || PyDict_SetItem(out, key, count) < 0;
    Py_XDECREF(key);
    Py_XDECREF(count);
    if (bad) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

int pool_init(PyObject* obj, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"ledger", "name", "private", "reserve", "release",
                                "buffer_type", nullptr};
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  PyObject *ledger, *name, *reserve, *release, *type;
  int is_private;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!UpOOO:Pool", const_cast<char**>(names),
                                   ledger_type, &ledger, &name, &is_private, &reserve,
                                   &release, &type))
    return -1;
  if (!PyType_Check(type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), buffer_base)) {
    PyErr_SetString(PyExc_TypeError, "buffer_type must be a subclass of BufferBase");
    return -1;
  }
  if (pool->free != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "a Pool is initialized once");
    return -1;
  }
  auto* t = reinterpret_cast<PyTypeObject*>(type);
  pool->plain = t->tp_basicsize == static_cast<Py_ssize_t>(sizeof(BufferObject)) &&
                t->tp_dictoffset == 0 && t->tp_init == buffer_base->tp_init;
  pool->free = new (std::nothrow) FreeLists();
  if (pool->free == nullptr) {
    PyErr_NoMemory();
    return -1;
  }
  Py_INCREF(ledger);
  Py_INCREF(name);
  Py_INCREF(reserve);
  Py_INCREF(release);
  Py_INCREF(type);
  pool->ledger = reinterpret_cast<LedgerObject*>(ledger);
  pool->name = name;
  pool->reserve = reserve;
  pool->release = release;
  pool->buffer_type = t;
  pool->is_private = static_cast<char>(is_private != 0);
  return 0;
}

// A pool and its allocator reference each other (reserve and release are the allocator's
// bound methods): the collector sees those references. Cached handles are left out, as in
// a buffer: they never reference a pool.
int pool_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  Py_VISIT(pool->reserve);
  Py_VISIT(pool->release);
  Py_VISIT(reinterpret_cast<PyObject*>(pool->buffer_type));
  Py_VISIT(reinterpret_cast<PyObject*>(pool->ledger));
  Py_VISIT(Py_TYPE(obj));
  return 0;
}

int pool_clear(PyObject* obj) {
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  Py_CLEAR(pool->reserve);
  Py_CLEAR(pool->release);
  return 0;
}

// A dropped pool drops its cached handles (as the Python pool's dict did): a closed pool
// has none, and the default pool lives as long as its device.
void pool_dealloc(PyObject* obj) {
  auto* pool = reinterpret_cast<PoolObject*>(obj);
  PyTypeObject* type = Py_TYPE(obj);
  PyObject_GC_UnTrack(obj);
  if (pool->free != nullptr) {
    for (auto& entry : *pool->free)
      for (PyObject* handle : entry.second) Py_DECREF(handle);
    delete pool->free;
    pool->free = nullptr;
  }
  Py_CLEAR(pool->reserve);
  Py_CLEAR(pool->release);
  Py_CLEAR(pool->name);
  Py_XDECREF(reinterpret_cast<PyObject*>(pool->buffer_type));
  Py_XDECREF(reinterpret_cast<PyObject*>(pool->ledger));
  type->tp_free(obj);
  Py_DECREF(type);
}

PyMethodDef pool_methods[] = {
    {"allocate", pool_allocate, METH_O, "allocate(nbytes): a buffer of at least nbytes bytes"},
    {"give_back", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(pool_give_back)),
     METH_FASTCALL, "give_back(handle, capacity): take a block back (Buffer.release)"},
    {"empty", pool_empty, METH_NOARGS, "Return every cached block to the device."},
    {"close", pool_close, METH_NOARGS,
     "Empty the pool; blocks still in use go to the device when they come back."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef pool_members[] = {
    {"name", T_OBJECT, offsetof(PoolObject, name), READONLY, "the pool's name"},
    {"private", T_BOOL, offsetof(PoolObject, is_private), READONLY,
     "a capture's pool (emptied only by close)"},
    {"closed", T_BOOL, offsetof(PoolObject, closed), READONLY, "closed: blocks go back"},
    {nullptr, 0, 0, 0, nullptr}};

PyGetSetDef pool_getset[] = {
    {"free", pool_free, nullptr,
     "{size class: cached blocks} (a copy; empty when nothing is cached)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot pool_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_init, reinterpret_cast<void*>(pool_init)},
    {Py_tp_dealloc, reinterpret_cast<void*>(pool_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(pool_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(pool_clear)},
    {Py_tp_methods, pool_methods},
    {Py_tp_members, pool_members},
    {Py_tp_getset, pool_getset},
    {Py_tp_doc, const_cast<char*>(
         "Pool(ledger, name, private, reserve, release, buffer_type): free blocks by size "
         "class (hal.allocator).")},
    {0, nullptr}};

PyType_Spec pool_spec = {"needle.hal._blocks.Pool", sizeof(PoolObject), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, pool_slots};

// From BufferBase's finalizer, so it never raises: an error (a closed pool's release
// failing) is reported as unraisable (dropped at interpreter exit), and an error already
// set is kept.
void give_back(PyObject* pool, PyObject* handle, long long capacity) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  int status;
  if (Py_TYPE(pool) == pool_type) {
    status = take_back(reinterpret_cast<PoolObject*>(pool), handle, capacity);
  } else {  // any object with give_back(handle, capacity)
    PyObject* done = PyObject_CallMethod(pool, "give_back", "OL", handle, capacity);
    Py_DECREF(handle);
    status = done == nullptr ? -1 : 0;
    Py_XDECREF(done);
  }
  if (status < 0) {
#if PY_VERSION_HEX >= 0x030D0000
    bool finalizing = Py_IsFinalizing();
#else
    bool finalizing = _Py_IsFinalizing();
#endif
    if (finalizing) PyErr_Clear();  // the device's module may be gone at interpreter exit
    else PyErr_WriteUnraisable(pool);
  }
  PyErr_Restore(type, value, traceback);
}

PyObject* add_type(PyObject* module, PyType_Spec* spec, const char* name) {
  PyObject* type = PyType_FromSpec(spec);
  if (type == nullptr) throw nb::python_error();
  Py_INCREF(type);  // one reference for the module, one for the static pointer
  if (PyModule_AddObject(module, name, type) < 0) throw nb::python_error();
  return type;
}

}  // namespace

NB_MODULE(_blocks, m) {
  m.doc() = "The caching allocator's buffers, pools and counters (see blocks.cc)";
  buffer_base = reinterpret_cast<PyTypeObject*>(add_type(m.ptr(), &buffer_spec, "BufferBase"));
  ledger_type = reinterpret_cast<PyTypeObject*>(add_type(m.ptr(), &ledger_spec, "Ledger"));
  pool_type = reinterpret_cast<PyTypeObject*>(add_type(m.ptr(), &pool_spec, "Pool"));
  m.def("size_class", &size_class, nb::arg("nbytes"),
        "The block size serving a request: 8 classes per power of two (waste under 12.5%).");
}
