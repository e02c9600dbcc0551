"""Question templates with gold SQL, for the bundled shop / hr / flights databases.

A template's `params` query enumerates its entities from the database itself; each row fills
the `{placeholders}` of the question (as text) and of the gold SQL (as SQL literals). Every
question names the columns to return, in order, and any ordering with its tie-breakers, so the
gold result is well defined.

- easy: one table, filter and projection (NULL checks included);
- medium: aggregates, GROUP BY / HAVING, ORDER BY / LIMIT;
- hard: joins, nested queries, NULL handling (LEFT JOIN, NOT EXISTS) and ties.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Difficulty = Literal["easy", "medium", "hard"]
DIFFICULTIES: tuple[Difficulty, ...] = ("easy", "medium", "hard")


@dataclass(frozen=True)
class Template:
    """One question family. The first column of `params` is the entity train/test split on."""

    id: str
    schema: str
    difficulty: Difficulty
    question: str
    sql: str
    params: str


def _t(id: str, difficulty: Difficulty, question: str, sql: str, params: str) -> Template:
    return Template(id, id.split(".", 1)[0], difficulty, " ".join(question.split()), " ".join(sql.split()), params)


def _values(name: str, *values: object) -> str:
    """A params query over constants: SELECT column1 AS name FROM (VALUES ...)."""
    rows = ", ".join(f"({v!r})" if not isinstance(v, str) else "('" + v + "')" for v in values)
    return f"SELECT column1 AS {name} FROM (VALUES {rows})"


SHOP = [
    # -- easy ---------------------------------------------------------------------------
    _t("shop.customers_in_city", "easy",
       "List the name and email of every customer who lives in {city}. Return columns: name, email.",
       "SELECT name, email FROM customers WHERE city = {city}",
       "SELECT DISTINCT city FROM customers ORDER BY city"),
    _t("shop.products_in_category", "easy",
       "Which products are in the '{category}' category? Return columns: name, price.",
       "SELECT name, price FROM products WHERE category = {category}",
       "SELECT DISTINCT category FROM products ORDER BY category"),
    _t("shop.pricey_products", "easy",
       "List the products that cost more than {price} (strictly more). Return columns: name, category, price.",
       "SELECT name, category, price FROM products WHERE price > {price}",
       _values("price", 120, 150, 175, 200, 220, 235)),
    _t("shop.orders_in_month", "easy",
       "List the id and order date of orders with status '{status}' placed in the month {month} (order_date starts with it). "
       "Return columns: id, order_date.",
       "SELECT id, order_date FROM orders WHERE status = {status} AND substr(order_date, 1, 7) = {month}",
       "SELECT DISTINCT status, substr(order_date, 1, 7) AS month FROM orders ORDER BY 1, 2"),
    _t("shop.customers_without_phone", "easy",
       "Which customers living in {country} have no phone number on file (phone is NULL)? Return columns: name, city.",
       "SELECT name, city FROM customers WHERE country = {country} AND phone IS NULL",
       "SELECT DISTINCT country FROM customers ORDER BY country"),
    # -- medium -------------------------------------------------------------------------
    _t("shop.customers_per_city", "medium",
       "How many customers live in each city of {country}? Return columns: city, customers; "
       "ordered by customers descending, then city ascending.",
       "SELECT city, COUNT(*) AS customers FROM customers WHERE country = {country} GROUP BY city ORDER BY customers DESC, city",
       "SELECT DISTINCT country FROM customers ORDER BY country"),
    _t("shop.category_prices", "medium",
       "For each product category whose average product price is above {price}, give the number of products and the "
       "average price rounded to 2 decimals. Return columns: category, products, avg_price; ordered by avg_price descending.",
       "SELECT category, COUNT(*) AS products, ROUND(AVG(price), 2) AS avg_price FROM products GROUP BY category "
       "HAVING AVG(price) > {price} ORDER BY avg_price DESC",
       _values("price", 100, 110, 120, 130, 140, 150, 160)),
    _t("shop.most_expensive", "medium",
       "What are the {n} most expensive products in stock (stock greater than 0)? Return columns: name, price; "
       "ordered by price descending, then name ascending.",
       "SELECT name, price FROM products WHERE stock > 0 ORDER BY price DESC, name LIMIT {n}",
       _values("n", 3, 4, 5, 6, 7, 8, 9, 10)),
    _t("shop.status_counts", "medium",
       "How many orders of each status were placed in the month {month} (order_date starts with it)? "
       "Return columns: status, orders; ordered by orders descending, then status ascending.",
       "SELECT status, COUNT(*) AS orders FROM orders WHERE substr(order_date, 1, 7) = {month} GROUP BY status "
       "ORDER BY orders DESC, status",
       "SELECT DISTINCT substr(order_date, 1, 7) AS month FROM orders ORDER BY 1"),
    _t("shop.frequent_customers", "medium",
       "Which customer ids placed at least {n} orders? Return columns: customer_id, orders; "
       "ordered by orders descending, then customer_id ascending.",
       "SELECT customer_id, COUNT(*) AS orders FROM orders GROUP BY customer_id HAVING COUNT(*) >= {n} "
       "ORDER BY orders DESC, customer_id",
       _values("n", 4, 5, 6, 7, 8)),
    # -- hard ---------------------------------------------------------------------------
    _t("shop.top_spenders", "hard",
       "Who are the {n} customers who spent the most on delivered orders? Spending is the sum of quantity * unit_price "
       "over the items of their orders with status 'delivered'. Return columns: name, total_spent (rounded to 2 decimals); "
       "ordered by total_spent descending, then name ascending.",
       "SELECT c.name, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS total_spent FROM customers c "
       "JOIN orders o ON o.customer_id = c.id JOIN order_items oi ON oi.order_id = o.id WHERE o.status = 'delivered' "
       "GROUP BY c.id ORDER BY total_spent DESC, c.name LIMIT {n}",
       _values("n", 3, 4, 5, 6, 7, 8, 10)),
    _t("shop.never_status", "hard",
       "Which customers from {country} have never had an order with status '{status}'? "
       "Customers with no orders at all count too. Return columns: name, city.",
       "SELECT c.name, c.city FROM customers c WHERE c.country = {country} AND NOT EXISTS "
       "(SELECT 1 FROM orders o WHERE o.customer_id = c.id AND o.status = {status})",
       "SELECT DISTINCT c.country, o.status FROM customers c, orders o ORDER BY 1, 2"),
    _t("shop.category_revenue", "hard",
       "What is the revenue per product category over orders with status '{status}'? Revenue is the sum of "
       "quantity * unit_price. Return columns: category, revenue (rounded to 2 decimals); ordered by revenue descending.",
       "SELECT p.category, ROUND(SUM(oi.quantity * oi.unit_price), 2) AS revenue FROM order_items oi "
       "JOIN products p ON p.id = oi.product_id JOIN orders o ON o.id = oi.order_id WHERE o.status = {status} "
       "GROUP BY p.category ORDER BY revenue DESC",
       "SELECT DISTINCT status FROM orders ORDER BY 1"),
    _t("shop.coupon_use", "hard",
       "For orders by customers from {country}, how many used a coupon and how many did not (coupon is NULL)? "
       "Return columns: used_coupon (1 if a coupon was used and 0 if not), orders; ordered by used_coupon descending.",
       "SELECT (o.coupon IS NOT NULL) AS used_coupon, COUNT(*) AS orders FROM orders o "
       "JOIN customers c ON c.id = o.customer_id WHERE c.country = {country} GROUP BY used_coupon ORDER BY used_coupon DESC",
       "SELECT DISTINCT country FROM customers ORDER BY 1"),
    _t("shop.best_sellers", "hard",
       "Which product(s) in the '{category}' category sold the most units over all orders that were not cancelled? "
       "If several products tie for the most, list them all. Return columns: name, units.",
       "SELECT p.name, SUM(oi.quantity) AS units FROM products p JOIN order_items oi ON oi.product_id = p.id "
       "JOIN orders o ON o.id = oi.order_id WHERE p.category = {category} AND o.status <> 'cancelled' GROUP BY p.id "
       "HAVING SUM(oi.quantity) = (SELECT MAX(total) FROM (SELECT SUM(oi2.quantity) AS total FROM order_items oi2 "
       "JOIN products p2 ON p2.id = oi2.product_id JOIN orders o2 ON o2.id = oi2.order_id "
       "WHERE p2.category = {category} AND o2.status <> 'cancelled' GROUP BY p2.id))",
       "SELECT DISTINCT category FROM products ORDER BY 1"),
]

HR = [
    # -- easy ---------------------------------------------------------------------------
    _t("hr.title_salary", "easy",
       "List the employees with the title '{title}' who earn at least {salary}. Return columns: first_name, last_name, salary.",
       "SELECT first_name, last_name, salary FROM employees WHERE title = {title} AND salary >= {salary}",
       "SELECT DISTINCT e.title, s.column1 AS salary FROM employees e, (VALUES (60000), (90000), (120000)) s ORDER BY 1, 2"),
    _t("hr.hired_in_year", "easy",
       "Which employees were hired in {year} (hire_date starts with the year)? Return columns: first_name, last_name, hire_date.",
       "SELECT first_name, last_name, hire_date FROM employees WHERE substr(hire_date, 1, 4) = {year}",
       "SELECT DISTINCT substr(hire_date, 1, 4) AS year FROM employees ORDER BY 1"),
    _t("hr.open_projects", "easy",
       "Which projects have no end date yet (end_date is NULL) and started on or before {day}? Return columns: name, start_date.",
       "SELECT name, start_date FROM projects WHERE end_date IS NULL AND start_date <= {day}",
       _values("day", "2022-06-01", "2022-12-31", "2023-06-30", "2023-09-30", "2023-12-31", "2024-06-30")),
    _t("hr.no_bonus", "easy",
       "Which employees with the title '{title}' have no bonus recorded (bonus is NULL)? Return columns: first_name, last_name.",
       "SELECT first_name, last_name FROM employees WHERE title = {title} AND bonus IS NULL",
       "SELECT DISTINCT title FROM employees WHERE title <> 'Director' ORDER BY 1"),
    _t("hr.big_projects", "easy",
       "List the projects with a budget of at least {budget}. Return columns: name, budget.",
       "SELECT name, budget FROM projects WHERE budget >= {budget}",
       _values("budget", 100000, 150000, 200000, 250000, 300000, 350000, 400000)),
    # -- medium -------------------------------------------------------------------------
    _t("hr.salary_by_title", "medium",
       "For each job title whose average salary is above {salary}, give the number of employees and the average salary "
       "rounded to 2 decimals. Return columns: title, employees, avg_salary; ordered by avg_salary descending.",
       "SELECT title, COUNT(*) AS employees, ROUND(AVG(salary), 2) AS avg_salary FROM employees GROUP BY title "
       "HAVING AVG(salary) > {salary} ORDER BY avg_salary DESC",
       _values("salary", 80000, 90000, 95000, 100000, 104000, 105000)),
    _t("hr.top_paid", "medium",
       "Who are the {n} highest-paid employees hired before {year}-01-01? Return columns: first_name, last_name, salary; "
       "ordered by salary descending, then last_name ascending, then first_name ascending.",
       "SELECT first_name, last_name, salary FROM employees WHERE hire_date < '{year}-01-01' "
       "ORDER BY salary DESC, last_name, first_name LIMIT {n}",
       "SELECT y.column1 AS year, n.column1 AS n FROM (VALUES (2014), (2016), (2018), (2020), (2022)) y, "
       "(VALUES (3), (5), (8)) n ORDER BY 1, 2"),
    _t("hr.headcount", "medium",
       "How many employees does each department have, counting only employees that have a department and only "
       "departments with at least {n} of them? Return columns: department_id, employees; ordered by employees descending, "
       "then department_id ascending.",
       "SELECT department_id, COUNT(*) AS employees FROM employees WHERE department_id IS NOT NULL GROUP BY department_id "
       "HAVING COUNT(*) >= {n} ORDER BY employees DESC, department_id",
       _values("n", 5, 10, 12, 14, 15, 17, 18)),
    _t("hr.hours_by_role", "medium",
       "On the project with id {project_id}, how many hours were logged per assignment role? "
       "Return columns: role, total_hours; ordered by total_hours descending, then role ascending.",
       "SELECT role, SUM(hours) AS total_hours FROM assignments WHERE project_id = {project_id} GROUP BY role "
       "ORDER BY total_hours DESC, role",
       "SELECT DISTINCT project_id FROM assignments ORDER BY 1"),
    _t("hr.hires_per_year", "medium",
       "How many employees with the title '{title}' were hired in each year? Return columns: year (the 4-digit year as text), "
       "hires; ordered by year descending (most recent first).",
       "SELECT substr(hire_date, 1, 4) AS year, COUNT(*) AS hires FROM employees WHERE title = {title} GROUP BY year "
       "ORDER BY year DESC",
       "SELECT DISTINCT title FROM employees WHERE title <> 'Director' ORDER BY 1"),
    # -- hard ---------------------------------------------------------------------------
    _t("hr.payroll", "hard",
       "For each department, how many employees hired before {year}-01-01 does it have and what is their total salary? "
       "Leave out departments without such employees. Return columns: department (the department name), employees, payroll; "
       "ordered by payroll descending.",
       "SELECT d.name AS department, COUNT(*) AS employees, SUM(e.salary) AS payroll FROM departments d "
       "JOIN employees e ON e.department_id = d.id WHERE e.hire_date < '{year}-01-01' GROUP BY d.id ORDER BY payroll DESC",
       _values("year", 2014, 2015, 2016, 2017, 2018, 2019, 2020, 2021, 2022)),
    _t("hr.reports_to", "hard",
       "List the employees whose manager is {manager}. Return columns: first_name, last_name, title.",
       "SELECT e.first_name, e.last_name, e.title FROM employees e JOIN employees m ON m.id = e.manager_id "
       "WHERE m.first_name || ' ' || m.last_name = {manager}",
       "SELECT DISTINCT m.first_name || ' ' || m.last_name AS manager FROM employees m JOIN employees e ON e.manager_id = m.id "
       "ORDER BY 1"),
    _t("hr.above_department_average", "hard",
       "Which employees of the {department} department earn more than the average salary of that department? "
       "Return columns: first_name, last_name, salary; ordered by salary descending, then last_name, then first_name.",
       "SELECT e.first_name, e.last_name, e.salary FROM employees e JOIN departments d ON d.id = e.department_id "
       "WHERE d.name = {department} AND e.salary > (SELECT AVG(e2.salary) FROM employees e2 WHERE e2.department_id = d.id) "
       "ORDER BY e.salary DESC, e.last_name, e.first_name",
       "SELECT name AS department FROM departments ORDER BY 1"),
    _t("hr.projects_since", "hard",
       "For every department, how many of its projects started in {year} or later? Include departments with none (0). "
       "Return columns: department (the department name), projects; ordered by department ascending.",
       "SELECT d.name AS department, COUNT(p.id) AS projects FROM departments d "
       "LEFT JOIN projects p ON p.department_id = d.id AND p.start_date >= '{year}-01-01' GROUP BY d.id ORDER BY department",
       _values("year", 2022, 2023, 2024)),
    _t("hr.project_staffing", "hard",
       "For each project of the {department} department, how many distinct employees are assigned to it and how many hours "
       "did they log? Include projects without assignments (0 employees, 0 hours). Return columns: project (the project "
       "name), employees, total_hours; ordered by total_hours descending, then project ascending.",
       "SELECT p.name AS project, COUNT(DISTINCT a.employee_id) AS employees, COALESCE(SUM(a.hours), 0) AS total_hours "
       "FROM projects p JOIN departments d ON d.id = p.department_id LEFT JOIN assignments a ON a.project_id = p.id "
       "WHERE d.name = {department} GROUP BY p.id ORDER BY total_hours DESC, project",
       "SELECT DISTINCT d.name AS department FROM departments d JOIN projects p ON p.department_id = d.id ORDER BY 1"),
]

FLIGHTS = [
    # -- easy ---------------------------------------------------------------------------
    _t("flights.departures", "easy",
       "List all flights leaving the airport with code {origin}. Return columns: flight_no, destination, departure.",
       "SELECT flight_no, destination, departure FROM flights WHERE origin = {origin}",
       "SELECT DISTINCT origin FROM flights ORDER BY 1"),
    _t("flights.long_flights", "easy",
       "Which flights take longer than {minutes} minutes (duration_min)? Return columns: flight_no, origin, destination, "
       "duration_min.",
       "SELECT flight_no, origin, destination, duration_min FROM flights WHERE duration_min > {minutes}",
       _values("minutes", 220, 230, 235, 240, 245, 250, 255)),
    _t("flights.passengers_born_before", "easy",
       "List the {nationality} passengers born before {year}. Return columns: name, birth_year.",
       "SELECT name, birth_year FROM passengers WHERE nationality = {nationality} AND birth_year < {year}",
       "SELECT DISTINCT p.nationality, y.column1 AS year FROM passengers p, (VALUES (1970), (1985), (2000)) y ORDER BY 1, 2"),
    _t("flights.big_delays", "easy",
       "Which delayed flights from {origin} were late by more than {minutes} minutes (delay_min)? "
       "Return columns: flight_no, delay_min.",
       "SELECT flight_no, delay_min FROM flights WHERE origin = {origin} AND delay_min > {minutes}",
       "SELECT DISTINCT f.origin, m.column1 AS minutes FROM flights f, (VALUES (30), (60), (120)) m ORDER BY 1, 2"),
    _t("flights.unseated", "easy",
       "Which bookings in '{seat_class}' class have no seat assigned (seat is NULL)? Return columns: id, flight_id, passenger_id.",
       "SELECT id, flight_id, passenger_id FROM bookings WHERE seat_class = {seat_class} AND seat IS NULL",
       "SELECT DISTINCT seat_class FROM bookings ORDER BY 1"),
    # -- medium -------------------------------------------------------------------------
    _t("flights.departures_per_airport", "medium",
       "How many flights depart from each airport in the month {month} (departure starts with it)? Only airports with at "
       "least {n} such flights. Return columns: origin, flights; ordered by flights descending, then origin ascending.",
       "SELECT origin, COUNT(*) AS flights FROM flights WHERE substr(departure, 1, 7) = {month} GROUP BY origin "
       "HAVING COUNT(*) >= {n} ORDER BY flights DESC, origin",
       "SELECT DISTINCT substr(departure, 1, 7) AS month, n.column1 AS n FROM flights, (VALUES (2), (3), (4)) n ORDER BY 1, 2"),
    _t("flights.average_delay", "medium",
       "For each origin airport with at least {n} delayed flights, what is the average delay of its delayed flights, in "
       "minutes rounded to 1 decimal? Return columns: origin, avg_delay; ordered by avg_delay descending, then origin.",
       "SELECT origin, ROUND(AVG(delay_min), 1) AS avg_delay FROM flights WHERE status = 'delayed' GROUP BY origin "
       "HAVING COUNT(*) >= {n} ORDER BY avg_delay DESC, origin",
       _values("n", 2, 3, 4, 5, 6, 7)),
    _t("flights.class_revenue", "medium",
       "For bookings priced above {price}, how many bookings and how much revenue (sum of price, rounded to 2 decimals) "
       "are there per seat class? Return columns: seat_class, bookings, revenue; ordered by revenue descending.",
       "SELECT seat_class, COUNT(*) AS bookings, ROUND(SUM(price), 2) AS revenue FROM bookings WHERE price > {price} "
       "GROUP BY seat_class ORDER BY revenue DESC",
       _values("price", 50, 100, 150, 200, 300, 400)),
    _t("flights.cheapest_from", "medium",
       "What are the {n} cheapest flights from {origin} by base fare? Return columns: flight_no, destination, base_fare; "
       "ordered by base_fare ascending, then flight_no ascending.",
       "SELECT flight_no, destination, base_fare FROM flights WHERE origin = {origin} ORDER BY base_fare, flight_no LIMIT {n}",
       "SELECT DISTINCT f.origin, n.column1 AS n FROM flights f, (VALUES (3), (5)) n ORDER BY 1, 2"),
    _t("flights.airline_status", "medium",
       "How many flights of the airline with id {airline_id} have each status? Return columns: status, flights; "
       "ordered by flights descending, then status ascending.",
       "SELECT status, COUNT(*) AS flights FROM flights WHERE airline_id = {airline_id} GROUP BY status "
       "ORDER BY flights DESC, status",
       "SELECT DISTINCT airline_id FROM flights ORDER BY 1"),
    # -- hard ---------------------------------------------------------------------------
    _t("flights.airline_cancellations", "hard",
       "For every airline, how many of its flights departing from airports in {country} were cancelled? Include airlines "
       "with none (0). Return columns: airline (the airline name), cancelled; ordered by cancelled descending, then airline.",
       "SELECT al.name AS airline, COUNT(f.id) AS cancelled FROM airlines al LEFT JOIN flights f ON f.airline_id = al.id "
       "AND f.status = 'cancelled' AND f.origin IN (SELECT code FROM airports WHERE country = {country}) "
       "GROUP BY al.id ORDER BY cancelled DESC, airline",
       "SELECT DISTINCT country FROM airports ORDER BY 1"),
    _t("flights.city_travellers", "hard",
       "Which passengers have a booking on a flight departing from an airport in {city}? List each passenger once. "
       "Return columns: name; ordered by name ascending.",
       "SELECT DISTINCT p.name FROM passengers p JOIN bookings b ON b.passenger_id = p.id JOIN flights f ON f.id = b.flight_id "
       "JOIN airports a ON a.code = f.origin WHERE a.city = {city} ORDER BY p.name",
       "SELECT DISTINCT city FROM airports ORDER BY 1"),
    _t("flights.top_spender", "hard",
       "Which {nationality} passenger(s) spent the most in total on bookings? If several tie, list them all. "
       "Return columns: name, total_spent (rounded to 2 decimals).",
       "SELECT p.name, ROUND(SUM(b.price), 2) AS total_spent FROM passengers p JOIN bookings b ON b.passenger_id = p.id "
       "WHERE p.nationality = {nationality} GROUP BY p.id HAVING SUM(b.price) = (SELECT MAX(s) FROM (SELECT SUM(b2.price) AS s "
       "FROM bookings b2 JOIN passengers p2 ON p2.id = b2.passenger_id WHERE p2.nationality = {nationality} GROUP BY p2.id))",
       "SELECT DISTINCT nationality FROM passengers ORDER BY 1"),
    _t("flights.unbooked", "hard",
       "Which flights from {origin} have no bookings at all? Return columns: flight_no, departure; ordered by departure "
       "ascending, then flight_no.",
       "SELECT f.flight_no, f.departure FROM flights f WHERE f.origin = {origin} AND NOT EXISTS "
       "(SELECT 1 FROM bookings b WHERE b.flight_id = f.id) ORDER BY f.departure, f.flight_no",
       "SELECT DISTINCT origin FROM flights ORDER BY 1"),
    _t("flights.no_status_bookings", "hard",
       "Per nationality, how many '{seat_class}' class bookings were made by passengers without a frequent-flyer status "
       "(frequent_flyer is NULL)? Return columns: nationality, bookings; ordered by bookings descending, then nationality.",
       "SELECT p.nationality, COUNT(*) AS bookings FROM bookings b JOIN passengers p ON p.id = b.passenger_id "
       "WHERE b.seat_class = {seat_class} AND p.frequent_flyer IS NULL GROUP BY p.nationality "
       "ORDER BY bookings DESC, p.nationality",
       "SELECT DISTINCT seat_class FROM bookings ORDER BY 1"),
]

TEMPLATES: tuple[Template, ...] = (*SHOP, *HR, *FLIGHTS)
