//! torch's own C accessors, called directly: the getter of a getset descriptor and a method
//! descriptor, each looked up once in the `__dict__` of the C type that defines it
//! (`torch._C.TensorBase`, `torch._C.StorageBase`).
//!
//! Two reasons. What they report comes from torch's C code, whatever a program has since
//! done to torch's Python classes (`torch.Tensor` is a Python class anyone may patch). And a
//! call skips what `obj.name` costs every time: the lookup through the instance's type and
//! its `__dict__`, and for a method the bound method in between; on the hot path of a queue
//! that is a dozen reads per tensor.

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// The descriptor `name` defined by `owner` itself (not inherited, not replaced by a
/// subclass).
fn own<'py>(owner: &Bound<'py, PyType>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    owner.getattr(pyo3::intern!(owner.py(), "__dict__"))?.get_item(name).map_err(|_| {
        PyRuntimeError::new_err(format!(
            "{} has no {name} of its own",
            owner.name().map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })
}

/// Whether `obj`'s type is `owner` or derives from it, by the type's MRO: what CPython
/// itself checks before it calls a descriptor of `owner` on `obj`, and what guarantees that
/// `obj` has `owner`'s C layout. (`isinstance` would ask `__instancecheck__`, which a
/// metaclass may override.)
fn is_instance(obj: &Bound<'_, PyAny>, owner: &Bound<'_, PyType>) -> bool {
    // SAFETY: both pointers are live objects, held by the borrows; PyType_IsSubtype only
    // reads the first type's MRO.
    unsafe { ffi::PyType_IsSubtype(ffi::Py_TYPE(obj.as_ptr()), owner.as_type_ptr()) != 0 }
}

fn not_instance(obj: &Bound<'_, PyAny>, owner: &Bound<'_, PyType>, name: &str) -> PyErr {
    let of = |t: Bound<'_, PyType>| t.name().map_or_else(|_| "?".into(), |n| n.to_string());
    PyTypeError::new_err(format!("{name} of a {}, which is no {}", of(obj.get_type()), of(owner.clone())))
}

/// The getter of a getset descriptor that `owner` defines.
pub(crate) struct Getter {
    /// A `getset_descriptor` whose `d_type` is `owner` and whose getter is set (checked in
    /// [`Getter::new`]); held, so its `PyGetSetDef` stays where it is.
    descr: Py<PyAny>,
    owner: Py<PyType>,
}

impl Getter {
    pub(crate) fn new(owner: &Bound<'_, PyType>, name: &str) -> PyResult<Getter> {
        let descr = own(owner, name)?;
        let p = descr.as_ptr();
        // SAFETY: `p` is a live object (held by `descr`). Its fields are read as those of a
        // `PyGetSetDescrObject` only once its type is `PyGetSetDescr_Type` exactly, which
        // CPython gives only to objects of that layout; `d_getset` of such a descriptor
        // points to the `PyGetSetDef` it was made from, which lives as long as its type.
        let ok = unsafe {
            ffi::Py_TYPE(p) == &raw mut ffi::PyGetSetDescr_Type
                && (*p.cast::<ffi::PyDescrObject>()).d_type == owner.as_type_ptr()
                && (*(*p.cast::<ffi::PyGetSetDescrObject>()).d_getset).get.is_some()
        };
        if !ok {
            return Err(PyRuntimeError::new_err(format!("{name} of torch's C type is not a C getter")));
        }
        Ok(Getter { descr: descr.unbind(), owner: owner.clone().unbind() })
    }

    /// `obj.<name>`, as the C getter reports it; a `TypeError` when `obj` is not an instance
    /// of the owner.
    pub(crate) fn get<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = obj.py();
        let owner = self.owner.bind(py);
        if !is_instance(obj, owner) {
            return Err(not_instance(obj, owner, "a getter"));
        }
        let p = self.descr.as_ptr();
        // SAFETY: `descr` is a getset descriptor of `owner` with a getter (checked in `new`;
        // the descriptor is held, and its `PyGetSetDef` lives with `owner`, held too), and
        // `obj` is an instance of `owner` by its MRO, so it has the C layout the getter was
        // written for: the call is the one CPython's `getset_get` makes after the same check,
        // with the GIL held (`py`). The getter returns a new reference or NULL with an
        // exception set, which `from_owned_ptr_or_err` takes as such.
        unsafe {
            let def = (*p.cast::<ffi::PyGetSetDescrObject>()).d_getset;
            let Some(get) = (*def).get else { unreachable!("checked in Getter::new") };
            Bound::from_owned_ptr_or_err(py, get(obj.as_ptr(), (*def).closure))
        }
    }
}

/// A method descriptor that `owner` defines, called with the instance as its first
/// argument: CPython checks the instance's type before the C function runs.
pub(crate) struct Method(Py<PyAny>);

impl Method {
    pub(crate) fn new(owner: &Bound<'_, PyType>, name: &str) -> PyResult<Method> {
        let descr = own(owner, name)?;
        // SAFETY: `descr` is a live object; only its type pointer is compared.
        if unsafe { ffi::Py_TYPE(descr.as_ptr()) } != &raw mut ffi::PyMethodDescr_Type {
            return Err(PyRuntimeError::new_err(format!("{name} of torch's C type is not a C method")));
        }
        Ok(Method(descr.unbind()))
    }

    /// `obj.<name>()`.
    pub(crate) fn call0<'py>(&self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.0.bind(obj.py()).call1((obj,))
    }

    /// `obj.<name>(arg)`.
    pub(crate) fn call1<'py>(
        &self,
        obj: &Bound<'py, PyAny>,
        arg: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.0.bind(obj.py()).call1((obj, arg))
    }

    /// The descriptor, to call with the instance first and then the arguments.
    pub(crate) fn bind<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.0.bind(py)
    }
}
